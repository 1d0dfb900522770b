# The two commands a user needs: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
TORCH_VERSION ?= 2.13.0

.PHONY: install prepare browser lint serve test bench clean

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

bench: install
	$(PY) -m evals.bench_forward

clean:
	rm -rf $(VENV) .pytest_cache
