"""Scoring a prompt: prompt logprobs in the engine, completions' `echo` with `logprobs` (and
`max_tokens` 0), vLLM's `prompt_logprobs` on both endpoints, and lm-evaluation-harness run
through the server against lm-eval's own transformers model.

Expectations come from transformers' float32 model: in exact mode (WEIGHTS=fp32,
NUMERICS=exact) every prompt logprob is its log-softmax bit for bit; the default mode's
approximate kernels are bounded.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from engine.backends import create_backend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.model.kernel_select import kernel_for
from engine.prompt_logprobs import positions_to_score
from engine.request import FinishReason, Sequence, TokenLogprob
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from tests.conftest import MODEL_ID, start_server, stop_server
from tests.gateway_helpers import sse_chunks
from tests.openapi_schema import COMPLETION_CHUNK, validate
from tests.paged_driver import hf_model

pytestmark = pytest.mark.slow

# The default mode's bounds against transformers' float32 logprobs, by the kernel WEIGHTS=auto
# picks on this CPU: (mean |difference| of a prompt's logprobs, largest |difference| of an
# lm-eval choice's summed loglik). int8 everywhere (no AMX) rounds more than bf16 layers with an
# int8 head. Measured: 0.23 and 0.79 (int8, an AVX512-VNNI CPU); under 0.2 and 0.5 (bf16-int8head).
DEFAULT_BOUNDS = {"bf16-int8head": (0.2, 0.5), "int8": (0.3, 1.2)}
DEFAULT_KERNEL = kernel_for("auto", "exact", torch.device("cpu"))

TEXT = (
    "Question: Which planet is known as the red planet?\nAnswer: Mars, because of the iron "
    "oxide on its surface. Question: What do bees make?\nAnswer: Honey."
)


# --- which positions a chunk scores (pure logic) --------------------------------------------


def test_a_chunk_scores_the_prompt_tokens_its_positions_predict_once():
    seq = Sequence(list(range(10)), SamplingParams(prompt_logprobs=0))
    assert positions_to_score(seq, 0, 4) == range(4)
    # The last prompt position predicts the first output token: not a prompt token.
    assert positions_to_score(seq, 4, 6) == range(4, 9)
    # Recomputed after preemption: what was scored already is not scored again.
    seq.prompt_logprobs = [TokenLogprob(1, -1.0)] * 3
    assert positions_to_score(seq, 0, 4) == range(3, 4)
    assert positions_to_score(Sequence(list(range(10)), SamplingParams()), 0, 10) == range(0)


# --- the engine against transformers --------------------------------------------------------


@pytest.fixture(scope="module")
def reference(embedded_model):
    """transformers' log-softmax over every position of TEXT's tokens."""
    ids = embedded_model.tokenizer(TEXT).input_ids
    model = hf_model(embedded_model.config, state_dict=embedded_model.state_dict)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, logprobs


def _engine(embedded_model, kernel: str, budget: int) -> LLMEngine:
    backend = create_backend("custom", embedded_model, torch.device("cpu"), torch.float32, kernel)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        kv=KVConfig(max_active_tokens=4096),
    )
    return LLMEngine.for_model(embedded_model, backend, config)


def _run(engine: LLMEngine, *seqs: Sequence) -> dict[int, list]:
    for seq in seqs:
        engine.add(seq)
    outputs: dict[int, list] = {seq.seq_id: [] for seq in seqs}
    while engine.has_work:
        for seq, out in engine.step():
            outputs[seq.seq_id].append(out)
    return outputs


@pytest.mark.parametrize("budget", [512, 16])
def test_exact_prompt_logprobs_equal_transformers_after_a_cache_hit_in_a_batch(
    embedded_model, reference, budget
):
    """Prefilled in one chunk, bit for bit. In chunks of 16 tokens, a chunk's attention and
    GEMMs have other shapes than transformers' whole-prompt ones and round differently, so
    there within float rounding."""
    ids, expected = reference
    engine = _engine(embedded_model, "exact", budget=budget)
    _run(engine, Sequence(ids, SamplingParams(max_tokens=2, temperature=0)))  # now cached
    scoring = Sequence(ids, SamplingParams(max_tokens=0, prompt_logprobs=3))
    other = Sequence(ids[:9], SamplingParams(max_tokens=12, temperature=0))
    outputs = _run(engine, scoring, other)[scoring.seq_id]

    (out,) = outputs  # prefill only: one output, no token
    assert out.new_token_ids == [] and out.finish_reason is FinishReason.LENGTH
    assert out.num_cached_tokens == 0  # every position's logits were computed
    entries = out.prompt_logprobs
    assert [e.token_id for e in entries] == ids[1:]
    for position, entry in enumerate(entries):
        row = expected[position]
        top = row.topk(3)
        if budget == 512:
            assert entry.logprob == row[ids[position + 1]].item()
            assert entry.rank == int((row > row[ids[position + 1]]).sum()) + 1
            assert entry.top == list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        else:
            assert entry.logprob == pytest.approx(row[ids[position + 1]].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == top.indices.tolist()


@pytest.mark.parametrize("kernel", ["bf16-int8head", "int8"])
def test_approximate_kernels_prompt_logprobs_are_bounded(embedded_model, reference, kernel):
    from engine.model.cpu_features import has_bf16, int8_weight_max

    if kernel.startswith("bf16") and not has_bf16():
        pytest.skip("this CPU has no oneDNN bfloat16 GEMM")
    ids, expected = reference
    engine = _engine(embedded_model, kernel, budget=512)
    seq = Sequence(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    (out,) = _run(engine, seq)[seq.seq_id]
    got = torch.tensor([e.logprob for e in out.prompt_logprobs])
    want = torch.tensor([expected[p, ids[p + 1]].item() for p in range(len(ids) - 1)])
    # Measured on this model (docs/scoring.md): mean 0.03 (bf16) and 0.09 (int8) nats; 0.20
    # with the 7-bit int8 weights of a CPU without VNNI (0.26 there through fbgemm).
    seven_bit = kernel == "int8" and int8_weight_max() < 127
    assert (got - want).abs().mean() < (0.3 if seven_bit else 0.2)
    assert (got - want).abs().max() < 1.5


# --- the HTTP API ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exact_server(tmp_path_factory):
    running = start_server(
        tmp_path_factory.mktemp("exact"), WEIGHTS="fp32", NUMERICS="exact", MAX_BATCH_SIZE="4"
    )
    yield running
    stop_server(running)


def _complete(base: str, **body) -> dict:
    response = httpx.post(base + "/v1/completions", json={"model": MODEL_ID, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(exact_server, reference):
    ids, expected = reference
    body = _complete(exact_server.base_url, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    validate(body, "CreateCompletionResponse")
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(len(ids) - 1):
        row = expected[position]
        token = ids[position + 1]
        assert logprobs["token_logprobs"][position + 1] == row[token].item()
        top = logprobs["top_logprobs"][position + 1]
        # The two most likely tokens, and the prompt's own token.
        assert max(top.values()) == row.max().item()
        assert len(top) <= 3


def test_echo_with_logprobs_then_generated_tokens(server, reference):
    ids, _ = reference
    body = _complete(server.base_url, prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                     temperature=0, ignore_eos=True)  # fmt: skip
    validate(body, "CreateCompletionResponse")
    choice = body["choices"][0]
    assert choice["text"].startswith(TEXT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    # Each prompt token's text sits at its offset; generated text starts after the echo.
    for token, offset in zip(logprobs["tokens"][1 : len(ids)], offsets[1 : len(ids)], strict=True):
        assert choice["text"][offset:].startswith(token)
    assert offsets[len(ids)] == len(TEXT)
    # Streamed, the same: the echo's chunk carries the prompt's logprobs.
    stream = {"model": MODEL_ID, "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3,
              "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    response = httpx.post(server.v1 + "/completions", json=stream, timeout=120)
    chunks = sse_chunks(response.content)
    for chunk in chunks:
        validate(chunk, COMPLETION_CHUNK)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for c in chunk["choices"]:
            for key in streamed:
                streamed[key] += (c.get("logprobs") or {}).get(key, [])
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == choice["text"]
    assert streamed == logprobs


def test_max_tokens_zero_scores_token_prompts_in_a_batch(server, reference):
    """lm-eval's request shape: several token-id prompts, echo, logprobs 1."""
    ids, expected = reference
    prompts = [ids, ids[:20]]
    body = _complete(server.base_url, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(ids), 20]
    for choice, prompt in zip(choices, prompts, strict=True):
        got = torch.tensor(choice["logprobs"]["token_logprobs"][1:])
        want = torch.tensor([expected[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)])
        assert (got - want).abs().mean() < DEFAULT_BOUNDS[DEFAULT_KERNEL][0]
    assert body["usage"]["prompt_tokens"] == len(ids) + 20
    assert body["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_on_both_endpoints(server):
    body = _complete(server.base_url, prompt=TEXT, prompt_logprobs=2, max_tokens=1, logprobs=0,
                     echo=True)  # fmt: skip
    choice = body["choices"][0]
    prompt_logprobs = choice["prompt_logprobs"]
    echo = choice["logprobs"]
    assert prompt_logprobs[0] is None
    assert len(prompt_logprobs) == len(echo["tokens"]) - 1  # the prompt's tokens
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and 2 <= len(entry) <= 3
        own = [e for e in entry.values() if e["decoded_token"] == echo["tokens"][position]]
        assert any(e["logprob"] == echo["token_logprobs"][position] for e in own)

    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}],
            "prompt_logprobs": 0, "max_tokens": 2}  # fmt: skip
    response = httpx.post(server.v1 + "/chat/completions", json=chat, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    validate(body, "CreateChatCompletionResponse")
    chat = body["prompt_logprobs"]
    assert chat[0] is None and len(chat) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in chat[1:])
    assert all(math.isfinite(next(iter(e.values()))["logprob"]) for e in chat[1:])


def test_a_cached_prompt_is_scored_in_full(server):
    prompt = TEXT + " Question: What is frozen water called?\nAnswer: Ice."
    cold = _complete(server.base_url, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    _complete(server.base_url, prompt=prompt, max_tokens=1)  # caches every block
    warm = _complete(server.base_url, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert warm["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "echo": True, "logprobs": 6}, "logprobs"),
    ],
)
def test_scoring_requests_we_refuse_name_the_field(server, body, param):
    response = httpx.post(server.v1 + "/completions", json={"model": MODEL_ID, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# --- lm-evaluation-harness -------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_eval_reference():
    from engine.model.loader import embedded_checkpoint_dir
    from evals.lm_eval_parity import hf_args, run_lm_eval

    return run_lm_eval("hf", hf_args(embedded_checkpoint_dir()), limit=4)


@pytest.mark.parametrize(
    ("mode", "tolerance"), [("exact", 1e-4), ("default", DEFAULT_BOUNDS[DEFAULT_KERNEL][1])]
)
def test_lm_eval_local_completions_matches_its_hf_model(
    request, lm_eval_reference, mode, tolerance
):
    """Same accuracy, per-choice logliks within float rounding (exact) or the default mode's
    bound, and the same pick on every question."""
    from engine.model.loader import EMBEDDED_MODEL, embedded_checkpoint_dir
    from evals.lm_eval_parity import compare, run_lm_eval, server_args

    running = request.getfixturevalue("exact_server" if mode == "exact" else "server")
    ours = run_lm_eval(
        "local-completions",
        server_args(running.base_url, EMBEDDED_MODEL, embedded_checkpoint_dir()),
        limit=4,
    )
    report = compare(ours, lm_eval_reference)
    assert report["choices"] == 16
    assert ours.accuracy == lm_eval_reference.accuracy
    assert report["documents_whose_pick_differs"] == 0
    assert report["max_abs_loglik_diff"] < tolerance, report


async def test_the_websocket_streams_an_echo_with_its_logprobs(server):
    from tests.test_websocket import open_ready, send, until_finished

    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    expected = _complete(server.base_url, **body)["choices"][0]
    ws = await open_ready(server)
    try:
        await send(ws, {"type": "generate", "id": "e", "model": MODEL_ID, **body})
        messages = await until_finished(ws, {"e"})
    finally:
        await ws.close()
    deltas = [m for m in messages if m["type"] == "delta"]
    assert "".join(m["text"] for m in deltas) == expected["text"]
    streamed: dict[str, list] = {key: [] for key in expected["logprobs"]}
    for delta in deltas:
        for key in streamed:
            streamed[key] += delta["logprobs"][key]
    assert streamed == expected["logprobs"]
