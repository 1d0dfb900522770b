"""Random draws for the sampler: the kept tokens of each row (min-p, top-k, top-p) and a
Gumbel-max race among them.

A draw is a Gumbel-max race (the exponential race vLLM samples with). Every kept
token v gets the score s_v + G(key, v), where s_v is its logit over the temperature (less the
row's largest) and G = -log(-log u) is Gumbel noise, with u computed by a counter-based hash of
the row's key and the token id alone; the token with the best score wins, which is a draw from
softmax(s) over the kept tokens. The uniforms have 32 bits, which bounds the noise: a token
whose probability is below about 2^-32 is drawn less often than it should be (such tokens hold
a negligible part of a real model's distribution). A seeded row's key is a hash of (seed, step)
(and the draw, for a grammar's retry), the same in every process, so its token depends only on
its own logits, parameters and step -- never on the other rows of the batch, the batch size or
the candidate set the batch works on; and a recomputed step draws the same token. As the noise
of a token does not move with the logits, logits that differ in their last bits (the same
request computed in another batch shape, under approximate kernels) change the token only
where two tokens' scores nearly tie: an inverse-CDF draw moved whenever the mass below the
drawn token did. Unseeded rows take a fresh key from torch's global generator (so
torch.manual_seed repeats them). On the CPU the race is a C++ kernel that skips the noise of
the tokens that cannot win (cpu_ops.gumbel_argmax); elsewhere, the same hash and race in torch
ops (race_torch).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from engine.model import cpu_ops
from engine.sampling import SamplingParams

# Candidates first tried for a top-p row without top-k; if their mass is below top_p the
# candidate set grows by _CANDIDATE_GROWTH until it covers every nucleus: exact either way.
_TOP_P_CANDIDATES = 1024
_CANDIDATE_GROWTH = 8
# The race's hash (csrc/cpu_ops.cpp describes it): 32-bit words in int64 tensors. Both
# multipliers are below 2^31, so no product of a word and one overflows int64.
WORD = 0xFFFFFFFF
_MIX_A, _MIX_B, _KEY_OFFSET = 0x21F0AAAD, 0x735A2D97, 0x9E3779B9
# The torch race works on at most this many (row, token) pairs at a time (but a whole row).
# On the CPU, fewer: its int64 temporaries then stay in the caches (`python -m
# evals.bench_sampler` times the race).
_RACE_CHUNK = 1 << 22
_RACE_CHUNK_CPU = 1 << 18


def seeded_key(seed: int, step: int, draw_index: int = 0) -> int:
    """The race key of a seeded row in [0, 2^63): a hash of (seed, step, and the draw for a
    grammar's retry), the same in every process."""
    text = f"{seed}:{step}" + (f":{draw_index}" if draw_index else "")
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    race_keys: Sequence[int],
    scratch: torch.Tensor,
) -> torch.Tensor:
    """One token per row of `logits`, drawn under its sampling `params`: the kept tokens of
    each row (min-p, top-k, top-p), then the race over them, keyed by `race_keys` (seeded_key
    for a seeded row). `scratch` is [rows, vocab] like `logits`."""
    device = logits.device
    inverse_temperature = inverse_temperatures(params, device)
    keys = torch.tensor(list(race_keys), dtype=torch.long, device=device)
    restricted = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if not restricted:
        return _from_vocabulary(logits, params, inverse_temperature, keys, scratch)
    if len(restricted) == len(params):
        return _from_candidates(logits, params, inverse_temperature, keys, scratch)
    token_ids = torch.empty(len(params), dtype=torch.long, device=device)
    restricted_set = set(restricted)
    for subset, choose in (
        ([i for i in range(len(params)) if i not in restricted_set], _from_vocabulary),
        (restricted, _from_candidates),
    ):
        index = torch.tensor(subset, dtype=torch.long, device=device)
        token_ids[index] = choose(
            logits[index],
            [params[i] for i in subset],
            inverse_temperature[index],
            keys[index],
            scratch[: len(subset)],
        )
    return token_ids


def _from_vocabulary(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    inverse_temperature: torch.Tensor,
    keys: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """Rows without top-k and top-p: min-p, then the race over the whole vocabulary."""
    if any(p.min_p > 0.0 for p in params):
        # Probability at least min_p times the largest: a logit at least the largest plus
        # temperature * log(min_p).
        margin = [
            [p.temperature * math.log(p.min_p) if p.min_p > 0.0 else -math.inf] for p in params
        ]
        floor = logits.max(dim=-1, keepdim=True).values + torch.tensor(
            margin, dtype=logits.dtype, device=logits.device
        )
        banned = logits.new_full((), -math.inf)
        logits = torch.where(logits < floor, banned, logits, out=scratch)
    return race(logits, inverse_temperature, keys)


def _from_candidates(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    inverse_temperature: torch.Tensor,
    keys: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """Rows with top-k and/or top-p: work on the most likely tokens instead of the vocabulary,
    then race over the kept ones."""
    device = logits.device
    vocab = logits.shape[1]
    scaled = logits
    if any(p.temperature != 1.0 for p in params):
        scaled = torch.mul(logits, inverse_temperature[:, None], out=scratch)
    probs = torch.softmax(scaled, dim=-1, out=scratch)  # in place when scaled into scratch
    acc = _accumulation_dtype(device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    has_top_k = torch.tensor([p.top_k > 0 for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=acc, device=device)
    min_p = torch.tensor([[p.min_p] for p in params], dtype=probs.dtype, device=device)

    width = max((p.top_k for p in params if p.top_k > 0), default=0)
    if not all(p.top_k > 0 for p in params):
        width = max(width, _TOP_P_CANDIDATES)
    width = min(width, vocab)
    full_mass = probs.sum(dim=-1, dtype=acc)
    while True:
        cand_probs, cand_ids = probs.topk(width, dim=-1)  # sorted, most likely first
        in_top_k = torch.arange(width, device=device) < top_k[:, None]
        kept_probs = torch.where(in_top_k, cand_probs, 0.0).to(acc)
        # top-p renormalizes over the top-k set; without top-k that set is the vocabulary.
        mass = torch.where(has_top_k, kept_probs.sum(dim=-1), full_mass)
        cumulative = (kept_probs / mass[:, None]).cumsum(dim=-1)
        enough = has_top_k | (cumulative[:, -1] >= top_p)
        if width == vocab or bool(enough.all()):
            break
        width = min(vocab, width * _CANDIDATE_GROWTH)  # some nucleus reaches further

    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    keep = in_top_k & (before < top_p[:, None])
    keep[:, 0] = True  # the nucleus is never empty (top_p 0, or below float32's smallest)
    keep &= cand_probs >= min_p * cand_probs[:, :1]
    # The race's noise is keyed by token id, so neither the candidates' order nor their
    # number (which depends on the other rows) changes the result.
    kept_logits = torch.where(keep, logits.gather(1, cand_ids), -math.inf)
    return race(kept_logits, inverse_temperature, keys, cand_ids)


def inverse_temperatures(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    return torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32, device=device)


def race(
    logits: torch.Tensor,
    inverse_temperature: torch.Tensor,
    keys: torch.Tensor,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, the token with the largest (logit - the row's largest) * inverse_temperature +
    Gumbel noise keyed by (the row's key, the token id): column c of `logits` is token c, or
    ids[row, c]. -inf marks a token that cannot be chosen; ties go to the smallest id."""
    if logits.device.type == "cpu" and cpu_ops.available():
        return cpu_ops.gumbel_argmax(logits, inverse_temperature, keys, ids)
    return race_torch(logits, inverse_temperature, keys, ids)


def race_torch(
    logits: torch.Tensor,
    inverse_temperature: torch.Tensor,
    keys: torch.Tensor,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """_race in torch ops, on any device: the hash and race of cpu_ops.gumbel_argmax, the noise
    in float64 (float32 on MPS, which has no float64), with no token skipped."""
    rows, width = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    chunk = _RACE_CHUNK_CPU if logits.device.type == "cpu" else _RACE_CHUNK
    step = max(1, chunk // width)
    if rows > step:
        return torch.cat(
            [
                race_torch(
                    logits[i : i + step],
                    inverse_temperature[i : i + step],
                    keys[i : i + step],
                    None if ids is None else ids[i : i + step],
                )
                for i in range(0, rows, step)
            ]
        )
    device = logits.device
    noise_dtype = torch.float32 if device.type == "mps" else torch.float64
    low, high = keys & WORD, keys >> 32
    a = mix32(low ^ mix32(high))[:, None]
    b = mix32(high ^ mix32(low ^ _KEY_OFFSET))[:, None]
    tokens = torch.arange(width, device=device)[None] if ids is None else ids
    bits = mix32(mix32((tokens + a) & WORD) ^ b)
    t = ((WORD - bits).to(noise_dtype) + 0.5) * 2.0**-32  # 1 - u
    noise = torch.log1p(-t).neg_().log_().neg_()
    top = logits.amax(dim=-1, keepdim=True)
    # Not NaN where top is infinite: a row of -inf stays -inf (its smallest id wins), and the
    # +inf tokens of a row tie (its first +inf token wins), as in the C++ kernel.
    top = torch.where(top.isfinite(), top, 0.0)
    scores = ((logits - top) * inverse_temperature[:, None]).to(noise_dtype) + noise
    scores = scores.nan_to_num_(nan=-math.inf, posinf=math.inf)  # a NaN logit never wins
    best = scores.max(dim=-1, keepdim=True).values
    tokens = tokens.expand(rows, width)
    return torch.where(scores == best, tokens, torch.iinfo(torch.long).max).min(dim=-1).values


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The race's 32-bit mixer (mix32 in csrc/cpu_ops.cpp) on int64 words below 2^32."""
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & WORD
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & WORD
    return x ^ (x >> 15)


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    """Dtype of running sums over the vocabulary.

    CUDA scans accumulate in the storage dtype, so they get float64. The CPU cumsum already
    accumulates float32 in double (each stored sum is off by at most float32 rounding, ~1e-7
    relative) and runs three times faster than a float64 one. MPS has no float64.
    """
    return torch.float64 if device.type == "cuda" else torch.float32
