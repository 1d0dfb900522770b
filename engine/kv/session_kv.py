"""What a conversation keeps between its turns, over the session pins (engine.kv.session_pins).

A finished turn pins its published blocks, so the next turn, whose prompt extends this one,
finds them in the prefix cache and prefills only its new tokens.

A turn that evicted is different: blocks computed after an eviction are never published (they
are wrong for anyone else), so it pins its whole block state instead: the tables with their
holes, the h2o scores and the tokens they cover (StreamingLLM semantics). The session's next
turn adopts that state when its tokens extend the kept ones and it asks for the same policy,
so it prefills only its new tokens against the bounded cache; otherwise the state is released
and the prompt is matched as usual. An adopted state leaves the pins (it is the sequence's
own), so a turn that frees it unfinished (preempted, aborted, or not admitted for want of
blocks) loses it, and the turn after that starts from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.kv.block_tables import SeqBlocks
from engine.kv.session_eviction import evicts
from engine.kv.session_pins import SessionPins
from engine.request import Sequence


@dataclass
class Kept:
    """A finished turn's evicted block state, kept whole for its session's next turn."""

    state: SeqBlocks
    token_ids: list[int]  # the tokens whose K/V the state holds: the turn's computed tokens
    cache_salt: str | None
    eviction_policy: str


class SessionKV:
    """Pins finished turns for their sessions and hands kept states to the turns that
    continue them."""

    def __init__(self, pins: SessionPins[Kept]) -> None:
        self.pins = pins
        self.num_resumed_kept = 0  # turns that continued their session's kept evicted cache

    def pin(self, seq: Sequence, state: SeqBlocks, now: float) -> None:
        """Pin seq's published blocks (or, after an eviction, its whole state) for its
        session."""
        assert seq.kv_session is not None
        kept = _kept_of(seq, state)
        if kept is not None:
            blocks = [b for table in state.tables.values() for b in table if b is not None]
        else:
            blocks = [
                block for index in range(len(state.path)) for block in state.held_at(index).values()
            ]
        self.pins.pin(seq.tenant, seq.kv_session, blocks, now, kept)

    def take_kept(self, seq: Sequence) -> Kept | None:
        """The kept state of seq's session if seq continues it (its pin's references pass to
        seq); a kept state seq does not continue is released."""
        if seq.kv_session is None:
            return None
        pin = self.pins.take_kept(seq.tenant, seq.kv_session)
        if pin is None:
            return None
        if pin.kept is not None and _continues(seq, pin.kept):
            self.num_resumed_kept += 1
            return pin.kept
        self.pins.drop(pin)
        return None


def _kept_of(seq: Sequence, state: SeqBlocks) -> Kept | None:
    """What seq's session keeps of a finished turn that evicted: its whole state, with no
    exact-match claim (that was this prompt's); None when nothing was evicted."""
    if state.first_evicted is None or not evicts(seq):
        return None
    return Kept(
        replace(state, prompt_claim=0),
        seq.token_ids[: seq.num_computed_tokens],
        seq.cache_salt,
        seq.eviction_policy,
    )


def _continues(seq: Sequence, kept: Kept) -> bool:
    """Whether seq's tokens extend the kept ones, under the same salt and policy, with at
    least one token left to compute."""
    num_kept = len(kept.token_ids)
    return (
        evicts(seq)
        and seq.eviction_policy == kept.eviction_policy
        and seq.cache_salt == kept.cache_salt
        and seq.num_tokens > num_kept
        and seq.token_ids[:num_kept] == kept.token_ids
    )
