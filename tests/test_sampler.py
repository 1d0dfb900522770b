import math
from collections import Counter

import pytest
import torch

from engine.logits_processors import adjust_logits
from engine.request import Sequence as EngineSequence
from engine.sampler import Sampler, SamplingRow
from engine.sampling import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 1


def row(step: int = 0, prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=64, **params), list(prompt), list(output), step)


def logits_from_probs(probs: list[float], vocab: int, device: str = "cpu") -> torch.Tensor:
    """Logits whose softmax puts `probs` on the first tokens and ~nothing on the rest."""
    logits = torch.full((vocab,), -60.0)
    logits[: len(probs)] = torch.tensor(probs).log()
    return logits.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 5000, device=device)
    out = Sampler().sample(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 3000)
    rows = [row(temperature=0.0), row(temperature=1.0, top_k=5), row(temperature=0.0), row()]
    out = Sampler().sample(logits, rows)
    expected = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == expected[0] and out.token_ids[2] == expected[2]


def test_caller_logits_are_not_modified():
    logits = torch.randn(2, 100)
    before = logits.clone()
    rows = [row(repetition_penalty=1.5, prompt=[3, 4], logit_bias={5: 3.0}), row(min_p=0.1)]
    Sampler(eos_token_ids=[EOS]).sample(logits, rows)
    assert torch.equal(logits, before)


def draws(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], steps: int):
    """Token ids of every row for steps 0..steps-1 (the step advances the seeded draw)."""
    per_step = []
    for step in range(steps):
        for r in rows:
            r.step = step
        per_step.append(sampler.sample(logits, rows).token_ids)
    return [list(col) for col in zip(*per_step, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_repeats_and_ignores_batch_composition(device):
    torch.manual_seed(2)
    vocab = 4000
    base = torch.randn(vocab, device=device) * 3
    sampler = Sampler()
    seeded = dict(seed=1234, temperature=0.8)

    alone = draws(sampler, base[None], [row(**seeded)], 40)[0]
    again = draws(sampler, base[None], [row(**seeded)], 40)[0]
    assert alone == again
    assert len(set(alone)) > 5  # it really samples

    # Same row at another position, next to greedy, unseeded, top-k and top-p rows.
    others = torch.randn(4, vocab, device=device) * 3
    batch = torch.cat([others[:2], base[None], others[2:]])
    rows = [row(temperature=0.0), row(), row(**seeded), row(top_k=50, seed=9), row(top_p=0.5)]
    assert draws(sampler, batch, rows, 40)[2] == alone

    other_seed = draws(sampler, base[None], [row(seed=4321, temperature=0.8)], 40)[0]
    assert other_seed != alone


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_top_k_top_p_does_not_depend_on_the_other_rows(device):
    torch.manual_seed(3)
    vocab = 5000
    base = torch.randn(vocab, device=device) * 2
    sampler = Sampler()
    params = dict(seed=77, top_k=40, top_p=0.9, min_p=0.01)
    alone = draws(sampler, base[None], [row(**params)], 30)[0]
    # A row with a much larger top_k widens the candidate set the batch works on.
    batch = torch.stack([torch.randn(vocab, device=device), base])
    mixed = draws(sampler, batch, [row(top_k=3000, seed=5), row(**params)], 30)[1]
    assert mixed == alone

    nucleus = dict(seed=78, top_p=0.95)
    alone = draws(sampler, base[None], [row(**nucleus)], 30)[0]
    mixed = draws(sampler, batch, [row(top_k=4000), row(**nucleus)], 30)[1]
    assert mixed == alone


def test_unseeded_sampling_follows_the_distribution():
    torch.manual_seed(4)
    probs = [0.5, 0.25, 0.125, 0.125]
    n = 8000
    logits = logits_from_probs(probs, 50).expand(n, -1)
    counts = Counter(Sampler().sample(logits, [row() for _ in range(n)]).token_ids)
    assert set(counts) == {0, 1, 2, 3}
    for token, p in enumerate(probs):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_seeded_draws_follow_the_distribution():
    probs = [0.6, 0.3, 0.1]
    logits = logits_from_probs(probs, 20)[None]
    n = 3000
    rows = [row(seed=s) for s in range(n)]  # one row, many seeds, all at step 0
    counts = Counter(Sampler().sample(logits.expand(n, -1), rows).token_ids)
    for token, p in enumerate(probs):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def support_and_frequencies(probs: list[float], vocab: int, n: int = 6000, **params):
    torch.manual_seed(5)
    logits = logits_from_probs(probs, vocab).expand(n, -1)
    counts = Counter(Sampler().sample(logits, [row(**params) for _ in range(n)]).token_ids)
    return set(counts), {t: c / n for t, c in counts.items()}


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    "params, support",
    [
        (dict(top_k=2), {0, 1}),
        (dict(top_k=1, temperature=5.0), {0}),
        (dict(top_p=0.65), {0, 1}),  # mass before token 2 is 0.7
        (dict(top_p=0.75), {0, 1, 2}),  # mass before token 3 is 0.85
        (dict(min_p=0.5), {0, 1}),  # threshold 0.2
        (dict(min_p=0.3), {0, 1, 2}),  # threshold 0.12
        # top-p on the top-3 distribution renormalized to 0.85: token 2 starts at 0.82 > 0.8
        (dict(top_k=3, top_p=0.8), {0, 1}),
        (dict(top_p=0.8), {0, 1, 2}),  # without top-k token 2 starts at 0.7
        (dict(top_k=4, min_p=0.3), {0, 1, 2}),
        (dict(top_p=0.95, min_p=0.3), {0, 1, 2}),  # nucleus of 4 tokens, min-p drops token 3
        (dict(top_p=0.0), {0}),  # OpenAI's top_p 0: the most likely token only
        (dict(top_k=3, top_p=0.0), {0}),
        (dict(top_p=1e-46), {0}),  # 0 in float32: still the most likely token
    ],
)
def test_filters_restrict_the_support_exactly(params, support):
    vocab = 3000
    seen, freq = support_and_frequencies(PROBS, vocab, **params)
    assert seen == support
    # What is kept keeps its relative odds.
    mass = sum(PROBS[t] for t in support)
    for t in support:
        p = PROBS[t] / mass
        assert abs(freq[t] - p) <= 5 * math.sqrt(p * (1 - p) / 6000)


def test_top_p_nucleus_larger_than_the_candidate_set():
    vocab = 3000
    logits = torch.full((vocab,), -80.0)
    logits[:1500] = -torch.arange(1500, dtype=torch.float32) * 1e-3
    probs = torch.softmax(logits.double(), dim=-1)
    cumulative = probs.cumsum(dim=-1)
    top_p = float((cumulative[1299] + cumulative[1300]) / 2)  # keeps tokens 0..1300
    n = 4000
    torch.manual_seed(6)
    out = Sampler().sample(logits.expand(n, -1), [row(top_p=top_p) for _ in range(n)])
    assert max(out.token_ids) <= 1300
    assert len(set(out.token_ids)) > 1100  # more than the 1024 first candidates


def test_penalties_change_logits_by_exact_amounts():
    logits = torch.tensor([[4.0, -3.0, 2.0, 1.0, 0.5, -1.0, 0.0]] * 3)
    rows = [
        # token 0 in the prompt, 1 in the output twice: both penalized once
        row(prompt=[0, 0], output=[1, 1], repetition_penalty=2.0),
        # output 2 x3, 3 x1; prompt tokens do not count
        row(prompt=[4], output=[2, 3, 2, 2], frequency_penalty=0.5, presence_penalty=0.25),
        row(
            output=[0], repetition_penalty=0.5, frequency_penalty=-1.0, logit_bias={6: 1.5, 5: -2.0}
        ),
    ]
    adjusted = adjust_logits(logits, rows, ())
    expected = torch.tensor(
        [
            [2.0, -6.0, 2.0, 1.0, 0.5, -1.0, 0.0],
            [4.0, -3.0, 2.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 0.5, -1.0, 0.0],
            # bias first, then repetition (4 / 0.5), then frequency (-(-1.0) x1)
            [4.0 / 0.5 + 1.0, -3.0, 2.0, 1.0, 0.5, -3.0, 1.5],
        ]
    )
    assert torch.equal(adjusted, expected)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2e-5])
def test_a_repetition_penalty_near_zero_keeps_the_draw_finite(temperature):
    # Token 1's positive logit divided by ~0 overflows float32; clamped, it takes all the mass
    # instead of turning the softmax into NaN (which drew arbitrary tokens).
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5] + [-5.0] * 96]).expand(8, -1)
    rows = [
        row(repetition_penalty=1e-300, prompt=[1, 2], temperature=temperature, seed=s)
        for s in range(8)
    ]
    sampler = Sampler()
    adjusted = adjust_logits(logits, rows, sampler.eos_token_ids)
    assert bool(adjusted.isfinite().all())
    assert adjusted[0, :3].tolist() == [2.0, pytest.approx(3.4e33, rel=0.01), -0.0]
    assert sampler.sample(logits, rows).token_ids == [1] * 8


def test_untouched_logits_are_returned_as_is():
    logits = torch.randn(2, 10)
    assert adjust_logits(logits, [row(), row(min_tokens=0)], [EOS]) is logits


def test_logit_bias_steers_greedy_choice_and_ignores_unknown_ids():
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    out = Sampler().sample(logits, [row(temperature=0.0, logit_bias={2: 6.0, 99: 100.0})])
    assert out.token_ids == [2]
    assert adjust_logits(logits, [row(logit_bias={2: 6.0, 99: 100.0})], ())[0, 2] == 6.0


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 1.0]])  # EOS=1, then stop id 2
    sampler = Sampler(eos_token_ids=[EOS])
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert sampler.sample(logits, [row(step=2, **params)]).token_ids == [3]
    assert sampler.sample(logits, [row(step=3, **params)]).token_ids == [1]
    # ignore_eos: EOS is an ordinary token, only the stop ids are held back
    ignoring = dict(params, ignore_eos=True)
    assert sampler.sample(logits, [row(step=0, **ignoring)]).token_ids == [1]
    adjusted = adjust_logits(logits, [row(step=0, **params)], sampler.eos_token_ids)
    assert adjusted[0].tolist() == [0.0, -math.inf, -math.inf, 7.0, 1.0]


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    torch.manual_seed(7)
    logits = torch.randn(4, 500)
    rows = [
        row(temperature=0.0, logprobs=5),
        row(temperature=0.7, top_k=10, repetition_penalty=1.3, prompt=[1, 2], logprobs=3),
        row(logprobs=None),
        row(temperature=0.0, logprobs=0),
    ]
    out = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i, k in [(0, 5), (1, 3), (3, 0)]:
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(reference[i, lp.token_id].item(), abs=1e-6)
        assert len(lp.top) == k
        values, ids = reference[i].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.logprobs[2] is None


def test_row_from_sequence():
    seq = EngineSequence(prompt_token_ids=[5, 6], sampling=SamplingParams(seed=3))
    seq.output_token_ids += [7, 8, 9]
    r = SamplingRow.from_sequence(seq)
    assert (r.prompt_token_ids, r.output_token_ids) == ([5, 6], [7, 8, 9])
    assert (r.step, r.params.seed) == (3, 3)


def test_tiny_temperature_is_greedy():
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    assert Sampler().sample(logits, [row(temperature=1e-7)]).token_ids == [1]


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [row()])
