"""Batched next-token sampling.

One call turns the logits of every sequence that needs a token this step into token ids
(and, where asked, logprobs). Per row, in this order:

1. logit bias is added;
2. repetition penalty (CTRL paper, Keskar et al. 2019): every token seen in prompt or output
   has a positive logit divided by the penalty and a negative one multiplied by it;
3. frequency and presence penalties (OpenAI semantics, output tokens only):
   logit -= frequency_penalty * count + presence_penalty * (count > 0);
4. while fewer than min_tokens tokens were generated, EOS (unless ignore_eos) and the stop
   token ids get logit -inf;
5. rows with a grammar (row.grammar, engine.structured) keep only the tokens it allows next;
   the others get logit -inf. The row's stop tokens (its stop_token_ids, and EOS unless
   ignore_eos) are allowed exactly when the grammar is complete, whatever the grammar calls
   EOS: a chat row ends on <end_of_turn>, say. Rows without a grammar pay nothing for this
   step, and a batch without any pays nothing at all. A row that chooses from its whole
   distribution first chooses without the mask and keeps a token the grammar allows, which
   is exact (Sampler._constrain): the mask is computed only for the rows it changes;
6. greedy rows (temperature below 1e-5) take the argmax; the others keep top-k of the
   distribution softmax(logits / temperature), then top-p of the renormalized top-k
   distribution (the smallest set of most likely tokens whose mass reaches top_p; the most
   likely token alone at top_p 0), then tokens with probability at least min_p times the
   largest, and draw from what is kept.

Logprobs (and the top alternatives) are those of the raw model output: log_softmax of the
logits as given, before any of the steps above, so they do not depend on sampling settings
(nor on a grammar: a token the grammar forced may have a low logprob).

Randomness: a draw is a Gumbel-max race keyed by (seed, step) for a seeded row, so a seeded
row's token depends on its own logits alone (engine.random_draw).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.logits_processors import adjust_logits, index_tensor
from engine.logprobs import sampled_logprobs
from engine.model import cpu_ops
from engine.random_draw import draw, inverse_temperatures, race, seeded_key
from engine.request import Sequence as EngineSequence
from engine.request import TokenLogprob
from engine.sampling import GREEDY_TEMPERATURE, SamplingParams
from engine.structured.bitmask import (
    allowed_tokens,
    apply_bitmask_rows,
    bitmask_words,
    set_bits,
)

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarMatcher

# A grammar's retry chooses among the allowed tokens alone when there are at most this many,
# instead of masking and scanning the whole vocabulary (Sampler._constrain).
_SPARSE_CHOICE = 4096


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    step: int  # tokens already generated; keys the seeded race and min_tokens
    grammar: GrammarMatcher | None = None  # the row's output constraint, read-only here
    draw: int = 0  # which draw of this step: a retry's randomness is independent of the first

    @classmethod
    def from_sequence(cls, seq: EngineSequence) -> SamplingRow:
        return cls(
            seq.sampling,
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.num_output_tokens,
            seq.grammar,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        # Scratch for the drawn rows (min-p's masked logits, top-k's and top-p's probabilities),
        # kept between calls: a fresh [32, 262144] float32 tensor each step is 32 MiB of new
        # pages (8,192 page faults), which cost more than the values written into them.
        self._probs = torch.empty(0)
        # The token bitmask of the rows with a grammar (int32, 32 tokens a word), kept too.
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def _probs_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A [rows, vocab] scratch tensor of `like`'s dtype and device (contents undefined)."""
        rows, vocab = like.shape
        buffer = self._probs
        if (
            buffer.shape[1:] != (vocab,)
            or buffer.shape[0] < rows
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(
                max(rows, buffer.shape[0]), vocab, dtype=like.dtype, device=like.device
            )
            self._probs = buffer
        return buffer[:rows]

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` ([N, vocab]); the caller's tensor is not changed."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        processed = adjust_logits(logits, rows, self.eos_token_ids)
        token_ids = self._choose(processed, rows)
        if any(r.grammar is not None for r in rows):
            self._constrain(processed, rows, token_ids)
        ids = token_ids.tolist()
        return SamplerOutput(
            ids, sampled_logprobs(logits, [r.params.logprobs for r in rows], token_ids)
        )

    def _constrain(
        self, processed: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
    ) -> None:
        """Step 5 for the rows with a grammar, given the tokens chosen without it (in place).

        A row that chooses from its whole distribution (greedy, or temperature alone) keeps a
        token its grammar allows: the greedy choice is then the masked argmax, and a draw is
        a draw from the masked distribution by rejection sampling, whose retry below uses
        fresh randomness (SamplingRow.draw). Only the rows whose token the grammar refuses,
        and rows with top-k, top-p or min-p (whose kept set the mask changes), pay for a
        mask: computing one takes milliseconds, checking a token microseconds.
        """
        ids = token_ids.tolist()
        redo: list[int] = []
        for i, row in enumerate(rows):
            if row.grammar is None:
                continue
            if not _whole_distribution(row.params) or not self._allows(row, ids[i]):
                redo.append(i)
        if not redo:
            return
        retried = [replace(rows[i], draw=rows[i].draw + 1) for i in redo]
        bitmask = self._grammar_bitmask(retried, processed.shape[1])
        full: list[int] = []  # positions in `redo` that need the whole masked row
        for j, (i, row) in enumerate(zip(redo, retried, strict=True)):
            allowed = allowed_tokens(bitmask[j], processed.shape[1], _SPARSE_CHOICE)
            if allowed is not None and len(allowed) and _whole_distribution(row.params):
                token_ids[i] = _choose_among(processed[i], allowed, row)
            else:
                full.append(j)
        if full:
            index = index_tensor([redo[j] for j in full], processed.device)
            masked = processed[index]  # a copy: the caller's logits stay as they were
            apply_bitmask_rows(masked, bitmask[full], list(range(len(full))))
            token_ids[index] = self._choose(masked, [retried[j] for j in full])

    def _allows(self, row: SamplingRow, token: int) -> bool:
        """Whether step 5 would have kept `token` for `row` (which has a grammar)."""
        assert row.grammar is not None
        if token in self._stop_ids(row.params):
            return row.grammar.is_accepting
        if token in self.eos_token_ids:  # the grammar's EOS while EOS is ignored
            return False
        return row.grammar.allows(token)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        """The tokens that end a row's output: its stop ids, and EOS unless it is ignored."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        return stop_ids

    def _choose(self, processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Step 6: one token id per row of the processed logits."""
        greedy = [i for i, r in enumerate(rows) if r.params.temperature < GREEDY_TEMPERATURE]
        if len(greedy) == len(rows):
            token_ids = _argmax(processed)
        elif not greedy:  # no row copies: at 16 rows of 262,144 logits a copy costs 1 ms
            token_ids = _draw(processed, rows, self._probs_buffer(processed))
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=processed.device)
            if greedy:
                index = index_tensor(greedy, processed.device)
                token_ids[index] = _argmax(processed[index])
            greedy_set = set(greedy)
            drawn = [i for i in range(len(rows)) if i not in greedy_set]
            index = index_tensor(drawn, processed.device)
            drawn_logits = processed[index]
            token_ids[index] = _draw(
                drawn_logits, [rows[i] for i in drawn], self._probs_buffer(drawn_logits)
            )
        return token_ids

    def apply_grammars(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], constrained: list[int]
    ) -> None:
        """Step 5, in place, on the rows listed in `constrained` (each has a grammar)."""
        bitmask = self._grammar_bitmask([rows[i] for i in constrained], logits.shape[1])
        apply_bitmask_rows(logits, bitmask, constrained)

    def _grammar_bitmask(self, rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
        """Row j: the tokens rows[j]'s grammar allows next, its stop tokens as step 5 says."""
        from engine.structured.compiler import fill_bitmasks

        bitmask = self._bitmask_buffer(len(rows), bitmask_words(vocab))
        matchers = [grammar for row in rows if (grammar := row.grammar) is not None]
        if len(matchers) != len(rows):
            raise ValueError("every constrained row needs a grammar")
        fill_bitmasks(matchers, bitmask)
        words = bitmask.numpy()
        for j, row in enumerate(rows):
            stop_ids = {t for t in self._stop_ids(row.params) if 0 <= t < vocab}
            if matchers[j].is_accepting:
                set_bits(words[j], sorted(stop_ids), allowed=True)
                # The grammar allows its own EOS ids once complete: not when EOS is ignored.
                set_bits(words[j], sorted(set(self.eos_token_ids) - stop_ids), allowed=False)
            else:  # a stop id the grammar allows as text would end the output unfinished
                set_bits(words[j], sorted(stop_ids), allowed=False)
        return bitmask

    def _bitmask_buffer(self, rows: int, words: int) -> torch.Tensor:
        """A [rows, words] int32 scratch bitmask (contents undefined)."""
        buffer = self._bitmask
        if buffer.shape[1] != words or buffer.shape[0] < rows:
            buffer = torch.empty(max(rows, buffer.shape[0]), words, dtype=torch.int32)
            self._bitmask = buffer
        return buffer[:rows]


def _choose_among(logits: torch.Tensor, allowed: torch.Tensor, row: SamplingRow) -> int:
    """Step 6 for one row that chooses from its whole distribution, over the `allowed` token
    ids (ascending) only: the same choice as over the row masked to them, for the cost of
    the few logits kept (a grammar often allows a handful of tokens)."""
    device = logits.device
    allowed = allowed.to(device)
    kept = logits[allowed]
    if row.params.temperature < GREEDY_TEMPERATURE:
        return int(allowed[_argmax(kept[None])[0]])
    inverse_temperature = inverse_temperatures([row.params], device)
    keys = torch.tensor(_keys([row]), dtype=torch.long, device=device)
    return int(race(kept[None], inverse_temperature, keys, allowed[None])[0])


def takes_argmax(row: SamplingRow) -> bool:
    """Whether Sampler.sample gives `row` the first maximum of its logits as they are, and no
    logprobs: greedy, with no logit bias, penalty, min_tokens ban or grammar. A step whose rows
    all do needs only that index (ModelRunner.forward's `greedy`)."""
    p = row.params
    return (
        p.temperature < GREEDY_TEMPERATURE
        and p.logprobs is None
        and not p.logit_bias
        and row.step >= p.min_tokens
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and row.grammar is None
    )


def _whole_distribution(params: SamplingParams) -> bool:
    """The row chooses from its whole (temperature-scaled) distribution: greedy, or no top-k,
    top-p or min-p."""
    return params.temperature < GREEDY_TEMPERATURE or (
        params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
    )


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row, as argmax gives it: cpu_ops.row_argmax on the CPU (one
    pass, rows shared between threads; `python -m evals.bench_sampler` times it), elsewhere
    max(dim).indices, which measured 3.6x faster than argmax on [16, 262144] float32 on the
    CPU (argmax's reduction is not vectorized there)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and cpu_ops.available()
    ):
        return cpu_ops.row_argmax(logits)
    return logits.max(dim=-1).indices


def _keys(rows: Sequence[SamplingRow]) -> list[int]:
    """One race key in [0, 2^63) per row: seeded_key for a seeded row; else a fresh one from
    torch's global generator."""
    unseeded = sum(r.params.seed is None for r in rows)
    fresh = iter(torch.randint(2**63 - 1, (unseeded,)).tolist() if unseeded else ())
    return [
        next(fresh) if r.params.seed is None else seeded_key(r.params.seed, r.step, r.draw)
        for r in rows
    ]


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow], scratch: torch.Tensor) -> torch.Tensor:
    """Random (non-greedy) rows: random_draw.draw with each row's parameters and key."""
    return draw(logits, [r.params for r in rows], _keys(rows), scratch)
