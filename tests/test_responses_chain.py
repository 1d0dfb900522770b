"""`previous_response_id` chains on the session's pinned KV, even while other traffic churns
the prefix cache: from the second response on, `cached_tokens` covers the whole history (all
but the previous turn's last partial block), and the prompt grows by exactly the new turn.

The expectations come from the responses' own usage, Gemma's turn format and /tokenize.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.gateway_helpers import api_metrics, unique_prompt

BLOCK_SIZE = 16
KV_TOKENS = 512  # small: the load below does not fit, so the prefix cache churns
TURNS = ["Name a color.", "Name another one.", "And a fruit?", "Which is sweeter?", "Thanks!"]


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("responses-chain"),
        MAX_ACTIVE_KV_TOKENS=str(KV_TOKENS),
        KV_BLOCK_SIZE=str(BLOCK_SIZE),
    )
    yield running
    stop_server(running)


def _reclaimed(base_url: str) -> int:
    groups = api_metrics(base_url)["kv"]["groups"]
    return sum(group["reclaimed"] for group in groups.values())


class _Load:
    """Distinct prompts, one at a time, until stopped; counts their prompt tokens."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.prompt_tokens = 0
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                body = {"model": MODEL_ID, "prompt": unique_prompt(60) * 3, "max_tokens": 1}
                response = client.post(self.base_url + "/v1/completions", json=body)
                if response.status_code != 200:
                    self.errors.append(response.text)
                    return
                self.prompt_tokens += response.json()["usage"]["prompt_tokens"]

    def wait_for(self, tokens: int) -> None:
        """Until the load has sent `tokens` more prompt tokens."""
        target = self.prompt_tokens + tokens
        while self.prompt_tokens < target and not self.errors:
            self.stop.wait(0.2)
        assert not self.errors, self.errors


def _new_turn_tokens(base_url: str, text: str) -> int:
    """The tokens a user turn adds after a model turn, in Gemma's turn format."""
    suffix = f"\n<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    body = {"prompt": suffix, "add_special_tokens": False}
    return httpx.post(base_url + "/tokenize", json=body, timeout=30).json()["count"]


def test_chain_of_five_keeps_its_history_cached_under_churn(tight: RunningServer) -> None:
    client = openai.OpenAI(base_url=tight.v1, api_key="none", timeout=300)
    capacity = api_metrics(tight.base_url)["kv"]["max_blocks_per_sequence"] * BLOCK_SIZE
    load = _Load(tight.base_url)
    load.thread.start()
    reclaimed_before = _reclaimed(tight.base_url)
    usages = []
    previous = None
    try:
        for turn in TURNS:
            if previous is not None:
                load.wait_for(capacity)  # the cache turns over between every two turns
            response = client.responses.create(
                model=MODEL_ID, input=turn, instructions="Answer in a few words.",
                previous_response_id=previous.id if previous else None,
                max_output_tokens=16, temperature=0,
            )  # fmt: skip
            assert response.usage is not None
            usages.append(response.usage)
            previous = response
    finally:
        load.stop.set()
        load.thread.join(timeout=120)
    assert not load.errors, load.errors
    # The load alone was several times what the KV cache holds, and cached blocks were
    # reclaimed for it.
    assert load.prompt_tokens >= capacity * (len(TURNS) - 1)
    assert _reclaimed(tight.base_url) > reclaimed_before
    cached = [u.input_tokens_details.cached_tokens for u in usages]
    print("cached_tokens per response:", cached, "input_tokens:", [u.input_tokens for u in usages])
    for i in range(1, len(TURNS)):
        before, now = usages[i - 1], usages[i]
        history = before.input_tokens + before.output_tokens
        # The previous prompt and output were computed but for the last token, sampled last.
        assert now.input_tokens_details.cached_tokens >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE
        # The prompt is the history's tokens, maybe an end-of-turn, then the new turn alone.
        added = now.input_tokens - history
        turn_tokens = _new_turn_tokens(tight.base_url, TURNS[i])
        assert added in (turn_tokens, turn_tokens + 1)
        assert now.input_tokens - now.input_tokens_details.cached_tokens <= added + BLOCK_SIZE
