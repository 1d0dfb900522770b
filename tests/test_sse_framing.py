"""SSE framing of a stream that fails after the response started: an OpenAI-shaped error
event, then [DONE]."""

from __future__ import annotations

import json

from app.routes_openai import _sse
from compat.errors import ApiError
from compat.response_types import Completion, CompletionChoice


async def failing_chunks():
    yield Completion(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text="Hi")]
    )
    raise ApiError("generation failed: device lost", status=500, code="internal_error")


async def test_a_failure_mid_stream_becomes_an_error_event_then_done():
    frames = [frame async for frame in _sse(failing_chunks())]
    assert frames[-1] == b"data: [DONE]\n\n"
    assert json.loads(frames[0][len(b"data: ") :])["choices"][0]["text"] == "Hi"
    assert frames[1].startswith(b"data: ") and frames[1].endswith(b"\n\n")
    assert json.loads(frames[1][len(b"data: ") :]) == {
        "error": {
            "message": "generation failed: device lost",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
