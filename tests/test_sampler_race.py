"""The sampler's Gumbel-max race (engine/sampler.py, "Randomness"): its noise and keys against a
reference written here from the specification, its distribution against softmax computed here
in float64, and what it promises that an inverse-CDF draw did not: a seeded token that survives
logits changed in their last bits. Paths: "kernel" is the C++ kernel (cpu_ops.gumbel_argmax),
"torch" the same race in torch ops (race_torch), which runs where the kernel does not."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine import sampler as sampler_module
from engine.model import cpu_ops
from engine.random_draw import race_torch
from engine.sampler import Sampler, SamplingRow, _keys
from engine.sampling import SamplingParams
from tests.conftest import ROOT

KERNEL = pytest.param(
    "kernel",
    marks=pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for cpu_ops"),
)
PATHS = [KERNEL, "torch"]
WORD = np.uint64(0xFFFFFFFF)


# The specification, in numpy's wrapping uint64 arithmetic (masked to 32 bits).
def mix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x21F0AAAD)) & WORD
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x735A2D97)) & WORD
    return x ^ (x >> np.uint64(15))


def reference_noise(keys: list[int], tokens: np.ndarray) -> np.ndarray:
    """G(key, token) = -log(-log u) for every key (rows) and token (columns), in float64."""
    key = np.asarray(keys, dtype=np.uint64)[:, None]
    low, high = key & WORD, key >> np.uint64(32)
    a = mix32(low ^ mix32(high))
    b = mix32(high ^ mix32(low ^ np.uint64(0x9E3779B9)))
    bits = mix32(mix32((tokens.astype(np.uint64) + a) & WORD) ^ b)
    one_minus_u = ((WORD - bits).astype(np.float64) + 0.5) / 2.0**32
    return -np.log(-np.log1p(-one_minus_u))


def reference_scores(logits: torch.Tensor, inverse_temperature: torch.Tensor, keys: list[int]):
    """s + G per token, s computed in float32 as the sampler computes it."""
    top = logits.amax(dim=-1, keepdim=True)
    s = ((logits - top) * inverse_temperature[:, None]).double().numpy()
    return s + reference_noise(keys, np.arange(logits.shape[1]))


def seeded_key(seed: int, step: int, draw: int = 0) -> int:
    text = f"{seed}:{step}" + (f":{draw}" if draw else "")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def race(path: str, logits, inverse_temperature, keys, ids=None) -> list[int]:
    keys = torch.as_tensor(keys, dtype=torch.long)
    if path == "kernel":
        return cpu_ops.gumbel_argmax(logits, inverse_temperature, keys, ids).tolist()
    return race_torch(logits, inverse_temperature, keys, ids).tolist()


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> Iterator[str]:
    """Which race Sampler.sample runs on the CPU."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_module.cpu_ops, "available", lambda: False)
    yield request.param


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=16, **params), [], [], 0)


def test_keys_hash_seed_step_and_draw():
    rows = [row(seed=1234), row(seed=1234), row(seed=-7), row(seed=2**70)]
    rows[1].step, rows[1].draw = 5, 1  # a grammar's retry at step 5
    assert _keys(rows) == [seeded_key(1234, 0), seeded_key(1234, 5, 1), seeded_key(-7, 0),
                           seeded_key(2**70, 0)]  # fmt: skip
    assert seeded_key(1234, 5, 1) != seeded_key(1234, 5)
    assert all(0 <= key < 2**63 for key in _keys([row(), row()]))


def test_unseeded_rows_repeat_under_manual_seed():
    logits = torch.randn(1, 5000).expand(64, -1)
    rows = [row() for _ in range(64)]
    torch.manual_seed(11)
    first = Sampler().sample(logits, rows).token_ids
    torch.manual_seed(11)
    assert Sampler().sample(logits, rows).token_ids == first
    assert len(set(first)) > 20


def test_seeded_tokens_are_the_same_in_another_process():
    """No per-process state (Python's salted hash()) in the key: another interpreter, with
    another hash seed, draws the same tokens."""
    script = (
        "import torch\n"
        "from engine.sampler import Sampler, SamplingRow\n"
        "from engine.sampling import SamplingParams\n"
        "logits = torch.linspace(-3, 3, 4000)[None].expand(32, -1)\n"
        "rows = [SamplingRow(SamplingParams(max_tokens=4, seed=s, temperature=0.9), [], [], 3)"
        " for s in range(32)]\n"
        "print(Sampler().sample(logits, rows).token_ids)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    logits = torch.linspace(-3, 3, 4000)[None].expand(32, -1)
    rows = [row(seed=s, temperature=0.9) for s in range(32)]
    for r in rows:
        r.step = 3
    assert result.stdout.strip().splitlines()[-1] == str(Sampler().sample(logits, rows).token_ids)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("inverse_temperature", [1e-3, 0.05, 1.0, 20.0, 1e5])
@pytest.mark.parametrize("path_name", PATHS)
def test_race_is_the_argmax_of_logits_plus_noise(path_name, vocab, inverse_temperature):
    """Every row's token is the argmax of the reference scores: the kernel's pruning skips only
    tokens that cannot win, whatever the temperature, at block edges, with banned (-inf)
    tokens, repeated largest logits and rows of a single finite logit."""
    generator = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[logits < -5] = -math.inf
    logits[1, :] = -math.inf
    logits[1, vocab // 2] = 0.5  # the only token allowed
    logits[2, :] = 3.0  # every token the largest
    logits[3, : vocab // 3] = logits[3].max()  # the largest, many times
    inverse = torch.full((rows,), inverse_temperature)
    keys = [seeded_key(s, vocab) for s in range(rows)]
    scores = reference_scores(logits, inverse, keys)
    order = np.sort(scores, axis=1)
    clear = (order[:, -1] - order[:, -2] > 1e-9) if vocab > 1 else np.ones(rows, dtype=bool)
    expected = scores.argmax(axis=1)
    got = np.array(race(path_name, logits, inverse, keys))
    assert clear.sum() >= rows - 4 or inverse_temperature < 0.01  # near-ties are rare
    assert (got[clear] == expected[clear]).all()
    assert got[1] == vocab // 2


@pytest.mark.parametrize("path_name", PATHS)
def test_rows_without_a_finite_logit(path_name):
    logits = torch.full((3, 100), -math.inf)
    logits[1, 7] = logits[1, 9] = math.inf  # a broken model: the first +inf wins
    logits[2, 40] = math.nan
    logits[2, 41] = 1.0
    assert race(path_name, logits, torch.ones(3), [1, 2, 3]) == [0, 7, 41]
    ids = torch.tensor([[9, 4, 6], [9, 7, 4]])
    logits = torch.tensor([[-math.inf] * 3, [math.inf, math.inf, 0.0]])
    assert race(path_name, logits, torch.ones(2), [1, 2], ids) == [4, 7]  # the smallest ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_torch_race_on_cuda_is_the_reference():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 50_000, generator=generator) * 3
    logits[logits < -6] = -math.inf
    inverse = torch.rand(32, generator=generator) + 0.5
    keys = [seeded_key(s, 1) for s in range(32)]
    scores = reference_scores(logits, inverse, keys)
    order = np.sort(scores, axis=1)
    clear = order[:, -1] - order[:, -2] > 1e-9
    cuda = torch.device("cuda")
    key_tensor = torch.tensor(keys, device=cuda)
    got = race_torch(logits.to(cuda), inverse.to(cuda), key_tensor).cpu().numpy()
    assert (got[clear] == scores.argmax(axis=1)[clear]).all()
    ids = torch.arange(50_000).flip(0).expand(32, -1).contiguous()
    flipped = race_torch(logits.flip(1).to(cuda), inverse.to(cuda), key_tensor, ids.to(cuda))
    assert (flipped.cpu().numpy()[clear] == got[clear]).all()


def test_kernel_and_torch_agree_on_a_large_vocabulary():
    if not cpu_ops.available():
        pytest.skip("no C++ compiler for cpu_ops")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 262_144, generator=generator) * 4
    inverse = torch.rand(64, generator=generator) * 2 + 0.3
    keys = torch.randint(2**63 - 1, (64,), generator=generator)
    kernel = cpu_ops.gumbel_argmax(logits, inverse, keys)
    assert torch.equal(kernel, race_torch(logits, inverse, keys))


@pytest.mark.parametrize("path_name", PATHS)
def test_candidate_order_and_width_do_not_matter(path_name):
    """Noise keyed by token id: racing any candidate subset that holds the winner, in any
    order, gives the full race's token; so does the whole row with the others banned."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 3000, generator=generator)
    inverse = torch.ones(8)
    keys = torch.arange(8) * 1_000_003
    full = race(path_name, logits, inverse, keys)
    ids = torch.stack([torch.randperm(3000, generator=generator) for _ in range(8)])[:, :1500]
    ids[:, 700] = torch.tensor(full)  # the winner among them
    assert race(path_name, logits.gather(1, ids), inverse, keys, ids) == full
    banned = torch.full_like(logits, -math.inf).scatter_(1, ids, logits.gather(1, ids))
    assert race(path_name, banned, inverse, keys) == full


def wilson_hilferty(dof: int, z: float = 4.5) -> float:
    """The chi-square quantile with `dof` degrees of freedom at the normal quantile z."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_follows(tokens: list[int], probs: np.ndarray) -> None:
    """Seeded draws `tokens` against the distribution `probs` (float64): nothing outside its
    support, and a chi-square over the tokens expected at least 5 times (the rest pooled)."""
    n = len(tokens)
    counts = Counter(tokens)
    assert all(probs[t] > 0 for t in counts), "a token outside the kept set"
    expected = probs * n
    big = np.flatnonzero(expected >= 5)
    observed = np.array([counts[t] for t in big] + [n - sum(counts[t] for t in big)], float)
    wanted = np.append(expected[big], n - expected[big].sum())
    keep = wanted > 1e-9
    statistic = float((((observed - wanted) ** 2)[keep] / wanted[keep]).sum())
    dof = int(keep.sum()) - 1
    assert statistic < wilson_hilferty(dof), (statistic, dof)


def kept_distribution(logits: np.ndarray, temperature: float, top_k=0, top_p=1.0, min_p=0.0):
    """The sampler's documented kept set, worked out here in float64, renormalized."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    ranked = p[order]
    in_k = np.arange(len(p)) < (top_k if top_k > 0 else len(p))
    mass_k = ranked[in_k].sum()
    before = np.concatenate([[0.0], np.cumsum(ranked[in_k] / mass_k)[:-1]])
    nucleus = np.zeros_like(in_k)
    nucleus[: in_k.sum()] = before < top_p
    nucleus[0] = True
    keep[order] = in_k & nucleus & (ranked >= min_p * ranked[0])
    kept = np.where(keep, p, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.3),
        dict(top_k=5),
        dict(top_p=0.8, temperature=0.9),
        dict(min_p=0.1),
        dict(top_k=12, top_p=0.9, min_p=0.05),
    ],
)
def test_seeded_draws_follow_softmax(path, params):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(40, generator=generator) * 1.5
    n = 20_000
    rows = [row(seed=s, **params) for s in range(n)]
    tokens = Sampler().sample(logits[None].expand(n, -1), rows).token_ids
    filters = {k: v for k, v in params.items() if k != "temperature"}
    probs = kept_distribution(logits.double().numpy(), params.get("temperature", 1.0), **filters)
    assert_follows(tokens, probs)


def test_seeded_draws_follow_softmax_over_a_large_vocabulary():
    """200,000 tokens in 10 groups of unequal mass, most of it spread thinly: the kernel's
    pruning works on blocks of these tokens, and the groups' frequencies must still match."""
    if not cpu_ops.available():
        pytest.skip("no C++ compiler for cpu_ops")
    generator = torch.Generator().manual_seed(4)
    groups, size = 10, 20_000
    logits = torch.randn(groups, size, generator=generator) - torch.arange(groups)[:, None] * 0.4
    logits = logits.flatten()
    n = 4000
    tokens = Sampler().sample(logits[None].expand(n, -1), [row(seed=s) for s in range(n)])
    probs = torch.softmax(logits.double(), 0).view(groups, size).sum(1).numpy()
    group_of = [t // size for t in tokens.token_ids]
    assert_follows(group_of, probs)


def test_steps_draw_independently():
    """A seed's tokens at consecutive steps are independent: a 2x2 table of (token at step 0,
    token at step 1) over a fair coin."""
    logits = torch.tensor([[0.0, 0.0]]).expand(8000, -1)
    rows = [row(seed=s) for s in range(8000)]
    first = Sampler().sample(logits, rows).token_ids
    for r in rows:
        r.step = 1
    second = Sampler().sample(logits, rows).token_ids
    pairs = Counter(zip(first, second, strict=True))
    assert_follows([2 * a + b for a, b in pairs.elements()], np.full(4, 0.25))


def test_a_seeded_token_survives_last_bit_changes(path):
    """The same seeded row with its logits changed by ~1e-3 relative noise, as another batch
    shape under approximate kernels changes them. By hand, from the reference scores: the token
    cannot change where the winner's lead over every token exceeds the two tokens' changes, and
    that holds for nearly every seed; an inverse-CDF draw over the same logits moves far more
    often."""
    vocab, n = 32_768, 300
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(vocab, generator=generator) * 2.0  # a high-entropy distribution
    changed = logits * (1 + 1e-3 * torch.randn(vocab, generator=generator))
    rows = [row(seed=s) for s in range(n)]
    before = np.array(Sampler().sample(logits[None].expand(n, -1), rows).token_ids)
    after = np.array(Sampler().sample(changed[None].expand(n, -1), rows).token_ids)

    scores = logits.double().numpy()[None] + reference_noise(
        [seeded_key(s, 0) for s in range(n)], np.arange(vocab)
    )
    winner = scores.argmax(axis=1)
    assert (before == winner).all()
    delta = (changed - logits).abs().double().numpy()
    lead = scores[np.arange(n), winner][:, None] - scores - delta[None] - delta[winner][:, None]
    lead[np.arange(n), winner] = math.inf
    safe = lead.min(axis=1) > 0
    assert safe.mean() > 0.97
    assert (before[safe] == after[safe]).all()
    assert (before != after).mean() < 0.03

    # Inverse-CDF sampling, one uniform per seed, in float64: most of the mass below the
    # drawn token moves by more than the token's own width.
    u = np.random.default_rng(0).random(n)
    moved = [
        np.searchsorted(np.cumsum(p), u * p.sum(), side="right")
        for p in (torch.softmax(x.double(), 0).numpy() for x in (logits, changed))
    ]
    assert (moved[0] != moved[1]).mean() > 0.2
