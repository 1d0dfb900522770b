"""The KV memory manager, the one object the scheduler asks for KV, over its parts: block
tables with copy-on-write and the sliding window, prefix sharing, what sessions keep between
turns (session_kv, session_pins) and per-session eviction (session_eviction).

Lifecycle of a sequence, as the scheduler drives it:

    cached = kv.match_prefix(seq)          # first scheduling (also after preemption)
    ok = kv.allocate(seq, num_new_tokens)  # before every step that computes tokens of seq
    chunk = kv.address(seq, num_new_tokens)  # its slots and held blocks, into the step's plan
    copies = kv.take_block_copies()        # into the plan: the runner copies before the forward
    ... forward; the scheduler advances seq.num_computed_tokens
    kv.record_attention(seq, keyed_mass)   # only for sequences with kv.wants_attention(seq)
    kv.commit(seq)                         # after each step that advanced seq
    kv.free(seq[, pin_at=now])             # finished, aborted, preempted; pinned: a session's

Session pins yield to memory pressure here, not in the scheduler: allocate() releases the
least recently used pins when the blocks asked for do not fit otherwise, and the capacity
figures count blocks held only by pins as free.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.kv.block_pool import Block, PagePool, make_pools
from engine.kv.block_tables import AllocationPlan, BlockCopy, BlockTables, ChunkKV
from engine.kv.integrity import check_all
from engine.kv.layout import CacheGroupSpec, SharedPages, primary_group
from engine.kv.prefix_cache import PrefixCache
from engine.kv.prefix_sharing import PrefixSharing
from engine.kv.session_eviction import KeyMass, SessionEviction
from engine.kv.session_kv import Kept, SessionKV
from engine.kv.session_pins import SessionPins
from engine.request import Sequence


class KVCacheManager:
    """Block tables of all sequences over one refcounted pool per cache group.

    groups: the model's cache groups; "full" is the primary group if present, else the first.
    num_blocks: blocks per group, one count for every group, or a page pool all groups share.
    block_size: tokens per block.
    enable_prefix_caching: share full blocks across sequences (radix tree + exact index).
    sink_tokens, h2o_recent_fraction: parameters of the `sink` and `h2o` eviction policies.
    pin_quota_blocks: the most primary-group blocks one tenant's session pins may hold.
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
        self.pools = make_pools(groups, num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.primary = primary_group(self.pools)
        self.windows = {g.name: g.sliding_window for g in groups}
        self.cache = PrefixCache(self.pools, self.primary, block_size, self.windows)
        for pool in self.pools.values():
            pool.reclaim_handler = self.cache.forget_block
        self.tables = BlockTables(self.pools, block_size, self.windows)  # checks block_size
        self.sharing = PrefixSharing(self.tables, self.cache, self.primary)
        self.pins: SessionPins[Kept] = SessionPins(self.pools, self.primary, pin_quota_blocks)
        self.sessions = SessionKV(self.pins)
        self.eviction = SessionEviction(self.tables, self.primary, sink_tokens, h2o_recent_fraction)

    # ------------------------------------------------------------------ capacity

    @property
    def max_blocks_per_sequence(self) -> int:
        """The most primary-group blocks one sequence can hold alone: what bounds its context."""
        return self.tables.max_blocks_per_sequence(self.primary)

    @property
    def num_free_blocks(self) -> int:
        """Blocks free for new work in the primary group: free, cached-unused, or held only by
        session pins (released on demand)."""
        return self._num_free(self.primary)

    @property
    def is_exhausted(self) -> bool:
        """Whether some group has no block left to hand out, even releasing session pins."""
        return any(self._num_free(group) == 0 for group in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1) in the most used group; blocks only
        cached or only pinned count as free."""
        return max(1.0 - self._num_free(g) / pool.num_total for g, pool in self.pools.items())

    def _num_free(self, group: str) -> int:
        pool = self.pools[group]
        return self._pages_available(pool.page_pool) // pool.pages_per_block

    def _pages_available(self, pages: PagePool, releasing_pins: bool = True) -> int:
        only_pinned = self.pins.pages_only_pinned(pages) if releasing_pins else 0
        return pages.num_available + only_pinned

    def _fits(self, plan: AllocationPlan, releasing_pins: bool) -> bool:
        needed = self.tables.pages_needed(plan)
        return all(
            count <= self._pages_available(pages, releasing_pins) for pages, count in needed.items()
        )

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate(seq, num_new_tokens) would succeed now (releasing session pins if
        need be). Does not change anything."""
        return self._fits(self.tables.plan(seq, num_new_tokens), releasing_pins=True)

    def largest_fit(self, seq: Sequence, wanted: int) -> int:
        """The most tokens, up to `wanted`, allocate() could give seq now (0 if none)."""
        if self.can_allocate(seq, wanted):
            return wanted
        low, high = 0, wanted - 1  # the answer lies in [low, high]; blocks grow with tokens
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.can_allocate(seq, mid) else (low, mid - 1)
        return low

    # ------------------------------------------------------------------ lifecycle

    def match_prefix(self, seq: Sequence) -> int:
        """First scheduling of a waiting sequence (new, or preempted): start it from its
        session's kept evicted state if it continues one (session_kv), else from the longest
        cached prefix of its tokens; returns the tokens whose K/V it now holds, as it sets
        seq.num_computed_tokens (and seq.num_cached_prompt_tokens, their prompt part). 0 with
        prefix caching off, or where prompt logprobs need every prompt position's logits."""
        if seq.seq_id in self.tables.seqs:  # held since an earlier, failed admission
            self.free(seq)
        state = self.tables.empty_state()
        cached = 0
        if self.enable_prefix_caching and seq.sampling.prompt_logprobs is None:
            kept = self.sessions.take_kept(seq)
            if kept is not None:
                state, cached = kept.state, len(kept.token_ids)
            else:
                cached = self.sharing.match(seq, state)
        self.tables.seqs[seq.seq_id] = state
        seq.num_computed_tokens = cached
        seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        return cached

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq slots for its next `num_new_tokens` positions (BlockTables.allocate),
        releasing the least recently used session pins until they fit. All-or-nothing:
        False, changing nothing, when they do not fit even with every pin released."""
        if num_new_tokens <= 0:
            return True
        plan = self.tables.plan(seq, num_new_tokens)
        if not self._fits(plan, releasing_pins=True):
            return False
        while not self._fits(plan, releasing_pins=False):
            released = self.pins.release_oldest()
            assert released, "pages counted as only pinned were not"
            plan = self.tables.plan(seq, num_new_tokens)  # a released pin may end a share
        self.tables.allocate(seq, plan)
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step advanced seq.num_computed_tokens: publish newly full blocks (and a
        computed prompt to the exact-match index), free sliding-group blocks wholly out of the
        window, and apply seq's eviction policy past seq.max_kv_tokens of KV."""
        state = self.tables.seqs.get(seq.seq_id)
        if state is None:
            return
        if self.enable_prefix_caching:
            self.sharing.publish(seq, state)
            self.sharing.register_prompt(seq, state, final=False)
        self.tables.free_out_of_window(state, seq.num_computed_tokens)
        self.eviction.evict(seq, state)

    def free(self, seq: Sequence, pin_at: float | None = None) -> None:
        """Release every block seq holds (finished, aborted or preempted); idempotent. Its
        computed blocks are published first and stay cached, reclaimable; with `pin_at` (a
        time) and seq.kv_session set, its session pins them (engine.kv.session_kv)."""
        state = self.tables.seqs.pop(seq.seq_id, None)
        if state is None:
            return
        if self.enable_prefix_caching:
            self.sharing.publish(seq, state)
            self.sharing.register_prompt(seq, state, final=True)
            if pin_at is not None and seq.kv_session is not None:
                self.sessions.pin(seq, state, pin_at)
        self.tables.release(state)

    def end_session(self, tenant: str, session: str) -> bool:
        """A conversation ended: release its pinned KV to the prefix cache (reclaimable)."""
        return self.pins.unpin(tenant, session)

    def release_idle_sessions(self, before: float) -> int:
        """Release the pins of sessions whose last turn ended before `before`; how many."""
        return self.pins.release_idle(before)

    # ------------------------------------------------------------------ the step's data

    def address(self, seq: Sequence, num_new_tokens: int) -> ChunkKV:
        """The addressing of seq's next `num_new_tokens` tokens (allocated already)."""
        return ChunkKV(
            self.tables.slots_for_new_tokens(seq, num_new_tokens),
            self.tables.layout(seq),
            self.wants_attention(seq),
        )

    def take_block_copies(self) -> list[BlockCopy]:
        """Copy-on-write copies queued by allocate() since the last call, in order."""
        return self.tables.take_block_copies()

    def take_page_assignments(self) -> list[Block]:
        """Blocks of several pages allocated since the last call, in order."""
        return self.tables.take_page_assignments()

    def wants_attention(self, seq: Sequence) -> bool:
        """Whether the runner should report attention mass for seq (h2o eviction)."""
        return self.eviction.wants_attention(seq)

    def record_attention(self, seq: Sequence, keyed: KeyMass) -> None:
        """Accumulate the attention mass seq's primary-group keys received in one step."""
        if (state := self.tables.seqs.get(seq.seq_id)) is not None:
            self.eviction.record(state, keyed)

    def check_integrity(self) -> None:
        """Raise KVIntegrityError if the bookkeeping contradicts itself (engine.kv.integrity)."""
        pinned = [block for pin in self.pins.all_pins() for block in pin.blocks]
        check_all(self.pools, self.cache, self.tables.seqs.values(), pinned)

    def stats(self) -> dict:
        """A JSON-able snapshot: capacity, block states, pins, cache hits, copies, evictions."""
        pages = self.pools[self.primary].page_pool
        shared = sum(p.page_pool is pages for p in self.pools.values()) > 1
        return {
            "block_size": self.block_size,
            "max_blocks_per_sequence": self.max_blocks_per_sequence,
            "num_free_blocks": self.num_free_blocks,
            "usage": self.usage,
            "num_sequences": len(self.tables.seqs),
            **self.pins.stats(),
            "resumed_kept": self.sessions.num_resumed_kept,
            "groups": {name: pool.stats() for name, pool in self.pools.items()},
            "shared_pages": pages.stats() if shared else None,
            "prefix_cache": self.cache.stats(),
            "cow_copies": self.tables.num_cow_copies,
            "evicted_blocks": self.eviction.num_evicted_blocks,
            "window_freed_blocks": self.tables.num_window_freed_blocks,
        }
