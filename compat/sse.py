"""Server-Sent Events framing for streamed responses: one `data:` event per chunk, then [DONE]."""

from __future__ import annotations

from typing import Any

import msgspec

SSE_DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """b"data: {json}\\n\\n" for a chunk Struct (or an error body, or any JSON-encodable value)."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"
