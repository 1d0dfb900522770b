"""The KV memory manager: per-sequence block tables over refcounted block pools, prefix
sharing through the prefix cache, sliding-window freeing and per-session eviction.

Lifecycle of a sequence, as the scheduler drives it:

    cached = kv.match_prefix(seq)          # first scheduling (also after preemption)
    ok = kv.allocate(seq, num_new_tokens)  # before every step that computes tokens of seq
    chunk = kv.address(seq, num_new_tokens)  # its slots and held blocks, into the step's plan
    copies = kv.take_block_copies()        # into the plan: the runner copies before the forward
    ... forward; the scheduler advances seq.num_computed_tokens
    kv.record_attention(seq, mass, slots)  # only for sequences with kv.wants_attention(seq)
    kv.commit(seq)                         # after each step that advanced seq
    kv.free(seq)                           # finished, aborted or preempted
    kv.free(seq, pin_at=now)               # finished turn of a session: keep its KV pinned

Session pins (engine.kv.session_pins). A finished turn of a conversation (seq.kv_session)
keeps references on its published blocks, so the next turn, whose prompt extends this one,
prefills only its new tokens. The scheduler releases the least recently used pin before it
shrinks a chunk or preempts, and idle pins after SESSION_KV_IDLE_S.

Kept evicted caches. Blocks computed after an eviction are never published (they are wrong for
anyone else), so a turn that evicted pins its whole block state instead: the tables with their
holes, the h2o scores and the tokens they cover (StreamingLLM semantics). The session's next
turn adopts that state when its tokens extend the kept ones and it asks for the same policy, so
it prefills only its new tokens against the bounded cache; otherwise the state is released and
the prompt is matched as usual. An adopted state leaves the pins (it is the sequence's own), so
a turn that frees it unfinished (preempted, aborted, or not admitted for want of blocks) loses
it, and the turn after that starts from the prefix cache.

One block pool per cache group ("full", "sliding"). Either each has pages of its own, of its
own number (engine.kv.sizing: sliding groups only get what their window can use), or all draw
from one shared page pool (SharedPages), a block of a group taking as many pages as its layers
need; then admission counts pages, so a group takes memory only as its sequences use it. All
counts are in blocks of `block_size` tokens. A token at position p of a sequence lives in that
group's block table[p // block_size] at offset p % block_size; its slot is
block_id * block_size + offset, on the block's first page (the runner maps its other pages).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace
from typing import Protocol

from engine.kv.block_pool import Block, BlockPool, PagePool
from engine.kv.eviction import EVICTION_POLICIES, EvictionPolicy, make_policy
from engine.kv.layout import CacheGroupSpec, SharedPages, primary_group
from engine.kv.prefix_cache import PrefixCache, RadixNode
from engine.kv.session_pins import SessionPins
from engine.kv.sizing import window_blocks
from engine.request import Sequence


class _ToList(Protocol):
    """A 1-D tensor or array (this module does not import torch)."""

    def tolist(self) -> list: ...


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the backend must copy physical block `src` to `dst` in `group`.

    Copies are produced by allocate() and must be applied in list order, all of them
    before the next forward writes any K/V (a released src may be reused as a later dst).
    A block of several pages (SharedPages) names them all: src's may be reassigned before
    the copy is applied, so they are not looked up then.
    """

    group: str
    src: int
    dst: int
    src_pages: tuple[int, ...] = ()  # empty for a block of one page: (src,)
    dst_pages: tuple[int, ...] = ()

    @property
    def pages(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(src pages, dst pages)."""
        return self.src_pages or (self.src,), self.dst_pages or (self.dst,)


@dataclass(frozen=True)
class KeyMass:
    """The attention mass one sequence's keys received in a step, for h2o's scores: mass[i]
    went to the primary group's key in slot key_slots[i] (lists or 1-D tensors)."""

    key_slots: SequenceOf[int] | _ToList
    mass: SequenceOf[float] | _ToList


@dataclass(frozen=True)
class ChunkKV:
    """Where one scheduled chunk's K/V are written and which keys it attends over, per cache
    group: what the model runner needs of the KV manager for one sequence in one step."""

    slots: dict[str, list[int]]  # the slot of each new token
    blocks: dict[str, list[tuple[int, int]]]  # held (block id, logical index), logical order
    wants_attention: bool = False  # h2o: report the attention mass its keys receive


@dataclass
class _SeqBlocks:
    """What the manager knows about one sequence holding blocks."""

    tables: dict[str, list[Block | None]]  # group -> logical block -> block (None: not held)
    path: list[RadixNode] = field(default_factory=list)  # cache nodes of blocks 0..len-1
    window_start: dict[str, int] = field(default_factory=dict)  # sliding: first block still held
    first_evicted: int | None = None  # lowest logical block dropped by the eviction policy
    scores: dict[int, float] = field(default_factory=dict)  # h2o: attention mass per block
    prompt_claim: int = 0  # tokens of the prompt registered in the exact-match index


@dataclass
class _Kept:
    """A finished turn's evicted block state, kept whole for its session's next turn."""

    state: _SeqBlocks
    token_ids: list[int]  # the tokens whose K/V the state holds: the turn's computed tokens
    cache_salt: str | None
    eviction_policy: str


class KVCacheManager:
    """Block tables of all sequences over one refcounted pool per cache group.

    groups: the model's cache groups (engine.backends.base.CacheGroupSpec); "full" is the
        primary group if present (every prefix-cache node has a block of it), else the first.
    num_blocks: blocks per group, one count for every group, or a page pool all groups share
        (the runner allocates the same)
    block_size: tokens per block.
    enable_prefix_caching: share and reuse full blocks across sequences (radix tree +
        exact-match index); when off, blocks are freed as soon as nobody holds them.
    sink_tokens, h2o_recent_fraction: parameters of the `sink` and `h2o` eviction policies.
    pin_quota_blocks: the most primary-group blocks one tenant's session pins may hold; None:
        no quota (pins still yield to memory pressure).
    """

    def __init__(
        self,
        groups: list[CacheGroupSpec],
        num_blocks: int | Mapping[str, int] | SharedPages,
        block_size: int,
        enable_prefix_caching: bool = True,
        sink_tokens: int = 4,
        h2o_recent_fraction: float = 0.5,
        pin_quota_blocks: int | None = None,
    ) -> None:
        if not groups:
            raise ValueError("the KV cache needs at least one cache group")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate cache group names: {names}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_specs = {g.name: g for g in groups}
        self.primary = primary_group(names)
        self.windows = {g.name: g.sliding_window for g in groups}
        if isinstance(num_blocks, SharedPages):
            pages = PagePool(num_blocks.num_pages)
            self.pools = {
                g.name: BlockPool(
                    g.name, pages=pages, pages_per_block=num_blocks.pages_per_block(g)
                )
                for g in groups
            }
        else:
            sizes = (
                num_blocks if isinstance(num_blocks, Mapping) else dict.fromkeys(names, num_blocks)
            )
            self.pools = {name: BlockPool(name, sizes[name]) for name in names}
        self.cache = PrefixCache(self.pools, self.primary, block_size, self.windows)
        for pool in self.pools.values():
            pool.reclaim_handler = self.cache.forget_block
        self._policies: dict[str, EvictionPolicy] = {
            name: make_policy(name, block_size, sink_tokens, h2o_recent_fraction)
            for name in EVICTION_POLICIES
        }
        self._seqs: dict[int, _SeqBlocks] = {}
        self._copies: list[BlockCopy] = []
        self.pins: SessionPins[_Kept] = SessionPins(self.pools, self.primary, pin_quota_blocks)
        self.num_resumed_kept = 0  # turns that continued their session's kept evicted cache
        self.num_cow_copies = 0
        self.num_evicted_blocks = 0  # dropped by per-session eviction policies
        self.num_window_freed_blocks = 0  # dropped by sliding windows

    # ------------------------------------------------------------------ capacity

    @property
    def max_blocks_per_sequence(self) -> int:
        """The most primary-group blocks one sequence can hold alone: what bounds its context.
        With shared pages, the other groups' blocks of such a sequence take pages too (a
        sliding group's at most its window)."""
        pool = self.pools[self.primary]
        sharing = [p for p in self.pools.values() if p.page_pool is pool.page_pool]

        def pages_for(blocks: int) -> int:
            pages = 0
            for other in sharing:
                window = self.windows[other.group]
                held = (
                    blocks
                    if window is None
                    else min(blocks, window_blocks(window, self.block_size))
                )
                pages += held * other.pages_per_block
            return pages

        low, high = 1, pool.page_pool.num_pages // pool.pages_per_block
        while low < high:  # the largest count that fits (at least 1)
            middle = (low + high + 1) // 2
            if pages_for(middle) <= pool.page_pool.num_pages:
                low = middle
            else:
                high = middle - 1
        return low

    @property
    def num_free_blocks(self) -> int:
        """Blocks free for new work in the primary group: free, cached-unused, or held only by
        session pins (released on demand)."""
        return self._num_free(self.primary)

    @property
    def is_exhausted(self) -> bool:
        """Whether some group has no block left to hand out."""
        return any(pool.num_available == 0 for pool in self.pools.values())

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1) in the most used group; blocks only
        cached or only pinned count as free."""
        return max(1.0 - self._num_free(g) / pool.num_total for g, pool in self.pools.items())

    def _num_free(self, group: str) -> int:
        pool = self.pools[group]
        only_pinned = self.pins.pages_only_pinned(pool.page_pool)
        return (pool.page_pool.num_available + only_pinned) // pool.pages_per_block

    def _fits(self, plan: dict[str, tuple[int, list[int]]]) -> bool:
        """Whether the page pools have the pages a _plan needs (groups sharing one add up)."""
        needed: dict[PagePool, int] = {}
        for group, (cow, new) in plan.items():
            pool = self.pools[group]
            pages = (cow + len(new)) * pool.pages_per_block
            needed[pool.page_pool] = needed.get(pool.page_pool, 0) + pages
        return all(count <= pages.num_available for pages, count in needed.items())

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks allocate(seq, num_new_tokens) would take now, in the group needing most
        (new blocks plus copy-on-write copies). Does not change anything."""
        state = self._seqs.get(seq.seq_id)
        tables = state.tables if state else {}
        plan = self._plan(tables, seq.num_computed_tokens, num_new_tokens)
        return max((cow + len(new) for cow, new in plan.values()), default=0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate(seq, num_new_tokens) would succeed now. Does not change anything."""
        state = self._seqs.get(seq.seq_id)
        tables = state.tables if state else {}
        return self._fits(self._plan(tables, seq.num_computed_tokens, num_new_tokens))

    # ------------------------------------------------------------------ lifecycle

    def match_prefix(self, seq: Sequence) -> int:
        """First scheduling of a waiting sequence (new, or preempted and to be recomputed).

        Finds the longest cached prefix of seq.token_ids under seq.cache_salt (exact-match
        index first for a sequence without output, then the radix tree), takes a reference
        on its blocks and returns its length in tokens. The length is a multiple of the
        block size except when the cached blocks cover every token, or the exact-match
        index has the prompt's partial last block: then it is num_tokens - 1, because at
        least one token is always recomputed to get logits (the shared block it lands in is
        copied on write by allocate()).

        Sets seq.num_computed_tokens to the returned value and seq.num_cached_prompt_tokens
        to its prompt part. Blocks still held from an earlier, failed attempt are released
        first. With prefix caching off, or for a sequence that wants prompt logprobs, it
        returns 0. Counts one query in stats() when it looks the prefix up.

        A turn of a session that kept an evicted cache (see the module doc) adopts it instead
        when its tokens extend the kept ones: it returns every token the kept state covers and
        counts no prefix-cache query.
        """
        if seq.seq_id in self._seqs:
            self.free(seq)
        state = _SeqBlocks(tables={g: [] for g in self.pools})
        cached = 0
        # Prompt logprobs need every prompt position's logits: such a sequence reads nothing
        # from the cache (it still publishes its blocks for others).
        if self.enable_prefix_caching and seq.sampling.prompt_logprobs is None:
            kept = self._take_kept(seq)
            if kept is not None:
                state, cached = kept.state, len(kept.token_ids)
                self.num_resumed_kept += 1
            else:
                cached = self._match_cached(seq, state)
        self._seqs[seq.seq_id] = state
        seq.num_computed_tokens = cached
        seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        return cached

    def _match_cached(self, seq: Sequence, state: _SeqBlocks) -> int:
        """Take references on the longest cached prefix of seq into `state`; its tokens."""
        exact_prompt = seq.prompt_token_ids if seq.num_output_tokens == 0 else None
        match = self.cache.match(seq.token_ids, seq.cache_salt, exact_prompt)
        for group, blocks in match.tables.items():
            for block in blocks:
                if block is not None:
                    self.pools[group].incref(block)
            state.tables[group] = list(blocks)
        cached = match.num_tokens
        state.path = match.nodes[: cached // self.block_size]
        for group, window in self.windows.items():
            if window is not None:
                state.window_start[group] = max(0, cached - window) // self.block_size
        return cached

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq slots for positions [num_computed_tokens, num_computed_tokens + num_new_tokens).

        All-or-nothing: returns False and changes nothing if any group lacks blocks.
        Blocks are added lazily; when the free queue is short, unreferenced cached blocks
        are reclaimed least-recently-used first. If the block the first new token lands in
        is shared (another holder, or cached), seq gets its own copy first and a BlockCopy
        is queued for take_block_copies(). Call again each step; num_new_tokens <= 0 is a
        no-op returning True.
        """
        if num_new_tokens <= 0:
            return True
        state = self._seqs.get(seq.seq_id)
        if state is None:
            state = _SeqBlocks(tables={g: [] for g in self.pools})
        plan = self._plan(state.tables, seq.num_computed_tokens, num_new_tokens)
        if not self._fits(plan):
            return False
        self._seqs[seq.seq_id] = state
        first = seq.num_computed_tokens // self.block_size
        for group, (cow, new) in plan.items():
            pool, table = self.pools[group], state.tables[group]
            if cow:
                src = table[first]
                assert src is not None  # _plan copies only a block seq holds
                dst = pool.allocate()
                pages = (src.pages, dst.pages) if pool.pages_per_block > 1 else ((), ())
                self._copies.append(BlockCopy(group, src.block_id, dst.block_id, *pages))
                self.num_cow_copies += 1
                table[first] = dst
                pool.decref(src)
            if new:
                table.extend([None] * (new[-1] + 1 - len(table)))
                for index in new:
                    table[index] = pool.allocate()
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step advanced seq.num_computed_tokens (and appended any sampled token).

        Publishes newly full blocks to the prefix cache (and the prompt to the exact-match
        index once it is computed), frees sliding-group blocks wholly out of the window,
        and applies seq.eviction_policy if seq holds more than seq.max_kv_tokens of KV.
        """
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        if self.enable_prefix_caching:
            self._publish(seq, state)
            self._register_prompt(seq, state, final=False)
        self._free_out_of_window(state, seq.num_computed_tokens)
        self._evict(seq, state)

    def free(self, seq: Sequence, pin_at: float | None = None) -> None:
        """Release every block seq holds (finished, aborted or preempted); idempotent.

        Full computed blocks are published first and stay in the prefix cache, so a
        session's next turn, a repeated prompt or a preempted sequence's recompute hits
        them; they are reclaimed least-recently-used when memory is needed. The prompt's
        partial last block is kept in the exact-match index when nothing else holds it.
        With `pin_at` (a time) and seq.kv_session set, the published blocks stay pinned for
        that session, or, once seq's eviction policy dropped blocks, its whole block state
        (see the module doc). Does not touch seq's fields (the scheduler resets
        num_computed_tokens on preemption).
        """
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        if self.enable_prefix_caching:
            self._publish(seq, state)
            self._register_prompt(seq, state, final=True)
            if pin_at is not None and seq.kv_session is not None:
                self._pin(seq, state, pin_at)
        for group, table in state.tables.items():
            pool = self.pools[group]
            for block in reversed(table):  # deepest first: leaves are reclaimed before parents
                if block is not None:
                    pool.decref(block)

    def take_page_assignments(self) -> list[Block]:
        """Blocks of several pages allocated since the last call, in order: the runner maps
        their pages before the next forward."""
        return [block for pool in self.pools.values() for block in pool.take_assignments()]

    def take_block_copies(self) -> list[BlockCopy]:
        """Copy-on-write copies queued by allocate() since the last call, in order; the
        engine hands them to the backend, which applies them before the forward."""
        copies, self._copies = self._copies, []
        return copies

    # ------------------------------------------------------------------ session pins

    def _pin(self, seq: Sequence, state: _SeqBlocks, now: float) -> None:
        """Pin seq's published blocks (or, after an eviction, its whole state) for its
        session."""
        assert seq.kv_session is not None
        kept = self._kept_of(seq, state)
        if kept is not None:
            blocks = [b for table in state.tables.values() for b in table if b is not None]
        else:
            blocks = [
                block
                for index in range(len(state.path))
                for block in self._held_at(state, index).values()
            ]
        self.pins.pin(seq.tenant, seq.kv_session, blocks, now, kept)

    def _kept_of(self, seq: Sequence, state: _SeqBlocks) -> _Kept | None:
        """What seq's session keeps of a finished turn that evicted: its whole state, with
        no exact-match claim (that was this prompt's); None when nothing was evicted."""
        if state.first_evicted is None or not self._evicts(seq):
            return None
        return _Kept(
            replace(state, prompt_claim=0),
            seq.token_ids[: seq.num_computed_tokens],
            seq.cache_salt,
            seq.eviction_policy,
        )

    def _take_kept(self, seq: Sequence) -> _Kept | None:
        """The kept state of seq's session if seq continues it (its pin's references pass to
        seq); a kept state seq does not continue is released."""
        if seq.kv_session is None:
            return None
        pin = self.pins.take_kept(seq.tenant, seq.kv_session)
        if pin is None:
            return None
        if pin.kept is not None and self._continues(seq, pin.kept):
            return pin.kept
        self.pins.drop(pin)
        return None

    def _continues(self, seq: Sequence, kept: _Kept) -> bool:
        """Whether seq's tokens extend the kept ones, under the same salt and policy, with at
        least one token left to compute."""
        num_kept = len(kept.token_ids)
        return (
            self._evicts(seq)
            and seq.eviction_policy == kept.eviction_policy
            and seq.cache_salt == kept.cache_salt
            and seq.num_tokens > num_kept
            and seq.token_ids[:num_kept] == kept.token_ids
        )

    @staticmethod
    def _evicts(seq: Sequence) -> bool:
        """Whether seq runs under an eviction policy with a KV budget."""
        return seq.eviction_policy != "none" and seq.max_kv_tokens is not None

    # ------------------------------------------------------------------ addressing

    def address(self, seq: Sequence, num_new_tokens: int) -> ChunkKV:
        """The addressing of seq's next `num_new_tokens` tokens (allocated already)."""
        return ChunkKV(
            self.slots_for_new_tokens(seq, num_new_tokens),
            self.layout(seq),
            self.wants_attention(seq),
        )

    def layout(self, seq: Sequence) -> dict[str, list[tuple[int, int]]]:
        """Per group, the blocks seq holds as (physical block id, logical block index), in
        logical order. Blocks dropped by a sliding window or an eviction policy are absent."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return {g: [] for g in self.pools}
        return {
            group: [(b.block_id, index) for index, b in enumerate(table) if b is not None]
            for group, table in state.tables.items()
        }

    def slots_for_new_tokens(self, seq: Sequence, num_new_tokens: int) -> dict[str, list[int]]:
        """Per group, the slot of each position in [num_computed_tokens, + num_new_tokens):
        the slot_mapping rows of this step. The positions must have been allocated."""
        state = self._seqs[seq.seq_id]
        start, bs = seq.num_computed_tokens, self.block_size
        positions = range(start, start + num_new_tokens)
        out: dict[str, list[int]] = {}
        for group, table in state.tables.items():
            slots = []
            for pos in positions:
                block = table[pos // bs]
                assert block is not None, f"position {pos} of seq {seq.seq_id} is not allocated"
                slots.append(block.block_id * bs + pos % bs)
            out[group] = slots
        return out

    # ------------------------------------------------------------------ eviction input

    def wants_attention(self, seq: Sequence) -> bool:
        """Whether the backend should report attention mass for seq (h2o eviction)."""
        return seq.eviction_policy == "h2o" and seq.max_kv_tokens is not None

    def record_attention(
        self,
        seq: Sequence,
        mass: SequenceOf[float] | _ToList,
        key_slots: SequenceOf[int] | _ToList,
    ) -> None:
        """Accumulate the attention mass seq's keys received in one step, per logical block
        (h2o scores). mass[i] belongs to the key in slot key_slots[i] of the primary group
        ("full" when the model has one, as RunnerOutput.attention_mass reports), e.g. the
        valid key slots the runner built from layout(); lists or 1-D tensors of equal length."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        masses = mass.tolist() if hasattr(mass, "tolist") else list(mass)
        slots = key_slots.tolist() if hasattr(key_slots, "tolist") else list(key_slots)
        if len(masses) != len(slots):
            raise ValueError(f"{len(masses)} attention masses for {len(slots)} key slots")
        table = state.tables[self.primary]
        logical = {b.block_id: index for index, b in enumerate(table) if b is not None}
        for value, slot in zip(masses, slots, strict=True):
            index = logical.get(slot // self.block_size)
            if index is not None:
                state.scores[index] = state.scores.get(index, 0.0) + value

    # ------------------------------------------------------------------ views

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks seq holds in the primary group (its KV footprint)."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return 0
        return sum(block is not None for block in state.tables[self.primary])

    def stats(self) -> dict:
        """A JSON-able snapshot: capacity, per-group block states, session pins and kept
        evicted caches, prefix-cache hits, copy-on-write copies and evicted blocks."""
        return {
            "block_size": self.block_size,
            "max_blocks_per_sequence": self.max_blocks_per_sequence,
            "num_free_blocks": self.num_free_blocks,
            "usage": self.usage,
            "num_sequences": len(self._seqs),
            "pinned_sessions": len(self.pins),
            "pinned_blocks": self.pins.pinned_blocks(),
            "released_pins": self.pins.num_released,
            "kept_sessions": self.pins.num_kept,
            "resumed_kept": self.num_resumed_kept,
            "groups": {
                name: {
                    "total": pool.num_total,
                    "pages_per_block": pool.pages_per_block,
                    "in_use": pool.num_in_use,
                    "cached_unused": pool.num_cached_unused,
                    "free": pool.num_free,
                    "reclaimed": pool.num_reclaimed,
                }
                for name, pool in self.pools.items()
            },
            "shared_pages": self._page_stats(),
            "prefix_cache": self.cache.stats(),
            "cow_copies": self.num_cow_copies,
            "evicted_blocks": self.num_evicted_blocks,
            "window_freed_blocks": self.num_window_freed_blocks,
        }

    def _page_stats(self) -> dict | None:
        """The shared page pool's pages (None when every group has pages of its own)."""
        pool = self.pools[self.primary].page_pool
        if not any(p.page_pool is pool for g, p in self.pools.items() if g != self.primary):
            return None
        return {"total": pool.num_pages, "free": pool.num_free, "cached": pool.num_cached_pages}

    # ------------------------------------------------------------------ internals

    def _plan(
        self, tables: dict[str, list[Block | None]], start: int, num_new_tokens: int
    ) -> dict[str, tuple[int, list[int]]]:
        """Per group: (1 if the block the first new token lands in must be copied, else 0;
        logical indices that need a new block)."""
        if num_new_tokens <= 0:
            return {g: (0, []) for g in self.pools}
        first, last = start // self.block_size, (start + num_new_tokens - 1) // self.block_size
        plan = {}
        for group in self.pools:
            table = tables.get(group, [])
            held = table[first] if first < len(table) else None
            cow = int(held is not None and (held.ref_count > 1 or held.owner is not None))
            new = [i for i in range(first, last + 1) if i >= len(table) or table[i] is None]
            plan[group] = (cow, new)
        return plan

    def _publish(self, seq: Sequence, state: _SeqBlocks) -> None:
        """Insert seq's newly full, computed blocks into the radix tree.

        Stops at the first block an eviction policy dropped: later blocks were computed
        without the dropped context and would be wrong for anyone else. Where the tree
        already has the block (computed by another sequence), seq switches to the cached
        copy and frees its own, so identical prefixes share memory.
        """
        bs = self.block_size
        limit = seq.num_computed_tokens // bs
        if state.first_evicted is not None:
            limit = min(limit, state.first_evicted)
        if state.path and state.path[-1].detached:
            state.path = []  # an ancestor was reclaimed: re-insert seq's blocks from the root
        if len(state.path) >= limit:
            return
        tokens = seq.token_ids
        parent = state.path[-1] if state.path else self.cache.root(seq.cache_salt)
        for index in range(len(state.path), limit):
            own = self._held_at(state, index)
            if self.primary not in own:
                break  # a single sliding group already dropped it: nothing to hang a node on
            node = self.cache.insert(parent, tuple(tokens[index * bs : (index + 1) * bs]), own)
            for group, block in own.items():
                cached = node.blocks.get(group)
                if cached is not None and cached is not block:
                    self.pools[group].incref(cached)
                    state.tables[group][index] = cached
                    self.pools[group].decref(block)
            state.path.append(node)
            parent = node

    def _register_prompt(self, seq: Sequence, state: _SeqBlocks, final: bool) -> None:
        """Record seq's prompt in the exact-match index once its K/V is all computed.

        The entry covers the prompt's full blocks (its deepest radix node) and, when the
        prompt ends mid-block, that partial block too: through the node of the block if
        output filled it, or, once seq is done writing (final), by handing seq's own partial
        block to the index.
        """
        prompt_len, bs = seq.num_prompt_tokens, self.block_size
        if state.prompt_claim >= prompt_len or seq.num_computed_tokens < prompt_len:
            return
        if state.first_evicted is not None and state.first_evicted * bs < prompt_len:
            return
        full, rest = divmod(prompt_len, bs)
        if len(state.path) < full:
            return
        tail: dict[str, Block] | None = None
        if rest == 0:
            node, claim = state.path[full - 1], prompt_len
        elif len(state.path) > full:
            node, claim = state.path[full], prompt_len
        else:
            node = state.path[full - 1] if full else self.cache.root(seq.cache_salt)
            claim = full * bs
            if final:
                own = self._held_at(state, full)
                if self.primary in own and all(
                    b.ref_count == 1 and b.owner is None for b in own.values()
                ):
                    tail, claim = own, prompt_len
        if claim > state.prompt_claim:
            # An entry already covering as much (another sequence's) also settles it.
            self.cache.register_exact(seq.cache_salt, seq.prompt_token_ids, node, claim, tail)
            state.prompt_claim = claim

    def _free_out_of_window(self, state: _SeqBlocks, num_computed: int) -> None:
        """Release sliding-group blocks whose keys are all older than the window.

        Keys at positions >= num_computed - window are kept (one more than a query at
        position num_computed strictly needs, so either window convention is safe).
        """
        for group, window in self.windows.items():
            if window is None:
                continue
            table, pool = state.tables[group], self.pools[group]
            end = min(max(0, num_computed - window) // self.block_size, len(table))
            for index in range(state.window_start.get(group, 0), end):
                block = table[index]
                if block is not None:
                    pool.decref(block)
                    table[index] = None
                    self.num_window_freed_blocks += 1
            state.window_start[group] = max(end, state.window_start.get(group, 0))

    def _evict(self, seq: Sequence, state: _SeqBlocks) -> None:
        """Apply seq's eviction policy when it holds more than its KV budget.

        Block-granular: the budget is max_kv_tokens // block_size blocks of the primary
        group (at least the policy's minimum); a dropped logical block is released in every
        group, disappears from layout(), and its h2o score is forgotten.
        """
        if seq.eviction_policy == "none" or seq.max_kv_tokens is None:
            return
        policy = self._policies.get(seq.eviction_policy)
        if policy is None:
            raise ValueError(
                f"unknown eviction policy {seq.eviction_policy!r}; "
                f"expected one of {EVICTION_POLICIES}"
            )
        budget = max(seq.max_kv_tokens // self.block_size, policy.min_blocks)
        held = [i for i, block in enumerate(state.tables[self.primary]) if block is not None]
        if len(held) <= budget:
            return
        victims = policy.select_victims(held, budget, state.scores)
        for index in sorted(victims, reverse=True):
            for group, table in state.tables.items():
                block = table[index] if index < len(table) else None
                if block is not None:
                    self.pools[group].decref(block)
                    table[index] = None
            state.scores.pop(index, None)
            self.num_evicted_blocks += 1
        if victims:
            lowest = min(victims)
            if state.first_evicted is None or lowest < state.first_evicted:
                state.first_evicted = lowest

    @staticmethod
    def _held_at(state: _SeqBlocks, index: int) -> dict[str, Block]:
        """The blocks seq holds at one logical index, per group."""
        return {
            group: block
            for group, table in state.tables.items()
            if index < len(table) and (block := table[index]) is not None
        }
