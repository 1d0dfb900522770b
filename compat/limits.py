"""Upper bounds on request fields whose size is the client's to choose.

Each bounds the work or memory one request may ask for; past it the request is a 400 naming
the field. They follow OpenAI's documented limits where it has them, and are looser where
vLLM clients commonly send more (several stop strings). `max_tokens` has no constant: it is
bounded by the context (the model's length minus the prompt) and the KV cache.
"""

MAX_N = 128  # choices per prompt (`n`, `best_of`): OpenAI's limit
MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; vLLM clients often send a few more
MAX_STOP_LENGTH = 256  # characters in one stop string
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on `logit_bias`
# Identity strings: each names a tenant or a session, which appear in logs, /metrics labels, the
# dashboard and per-tenant state, so their size multiplies. OpenAI's spec bounds only
# `safety_identifier` (64); `user` and X-Session-Id get room for any hashed or composite id.
MAX_IDENTIFIER_LENGTH = 256  # characters in `user` and the X-Session-Id header
MAX_SAFETY_IDENTIFIER_LENGTH = 64  # OpenAI's limit
