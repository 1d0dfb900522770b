"""Small helpers shared by the gateway end-to-end tests (test_gateway_*.py)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import MODEL_ID

# One event is exactly `data: <one line>` and a blank line; nothing else may appear in a stream.
_SSE_STREAM = re.compile(rb"(?:data: [^\n]+\n\n)+")


def sse_payloads(raw: bytes) -> list[str]:
    """The `data:` payloads of a raw SSE body, after checking its exact framing."""
    assert _SSE_STREAM.fullmatch(raw), f"not SSE framing: {raw[:300]!r}"
    assert raw.endswith(b"data: [DONE]\n\n")
    return [event[len(b"data: ") :].decode() for event in raw.split(b"\n\n")[:-1]]


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a raw SSE body (without the closing [DONE])."""
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def api_metrics(base_url: str) -> dict[str, Any]:
    response = httpx.get(base_url + "/api/metrics", timeout=30)
    assert response.status_code == 200
    return response.json()


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 15.0, interval_s: float = 0.1
) -> bool:
    """Poll `condition` until it holds (True) or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def unique_prompt(words: int = 8) -> str:
    """A prompt no earlier request shares a prefix with (beyond BOS): no prefix-cache hits."""
    filler = " ".join(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"] * 8)
    return f"{uuid.uuid4().hex} " + " ".join(filler.split()[:words])


def chat_body(content: str = "Name three colors.", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], **fields}


def completion_body(prompt: str = "The capital of France is", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": prompt, **fields}
