"""Per-sequence block tables over refcounted block pools: allocation with copy-on-write, the
sliding window's freeing, and the addressing the model runner gets for a step.

A token at position p of a sequence lives in its group's table[p // block_size] at offset
p % block_size; its slot is block_id * block_size + offset, on the block's first page (the
runner maps a multi-page block's other pages). A table entry is None where the window or an
eviction policy dropped the block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.kv.block_pool import Block, BlockPool, PagePool
from engine.kv.prefix_cache import RadixNode
from engine.kv.sizing import window_blocks
from engine.request import Sequence

# Per group: (1 if the block the first new token lands in must be copied, else 0; logical
# indices that need a new block).
AllocationPlan = dict[str, tuple[int, list[int]]]


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the runner must copy physical block `src` to `dst` in `group`.

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
class ChunkKV:
    """Where one scheduled chunk's K/V are written and which keys it attends over, per cache
    group: what the model runner needs of the KV manager for one sequence in one step."""

    slots: dict[str, list[int]]  # the slot of each new token
    blocks: dict[str, list[tuple[int, int]]]  # held (block id, logical index), logical order
    wants_attention: bool = False  # h2o: report the attention mass its keys receive


@dataclass
class SeqBlocks:
    """What the KV manager knows about one sequence holding blocks."""

    tables: dict[str, list[Block | None]]  # group -> logical block -> block (None: not held)
    path: list[RadixNode] = field(default_factory=list)  # cache nodes of blocks 0..len-1
    window_start: dict[str, int] = field(default_factory=dict)  # sliding: first block still held
    first_evicted: int | None = None  # lowest logical block dropped by the eviction policy
    scores: dict[int, float] = field(default_factory=dict)  # h2o: attention mass per block
    prompt_claim: int = 0  # tokens of the prompt registered in the exact-match index

    def held_at(self, index: int) -> dict[str, Block]:
        """The blocks held at one logical index, per group."""
        return {
            group: block
            for group, table in self.tables.items()
            if index < len(table) and (block := table[index]) is not None
        }


class BlockTables:
    """Every sequence's SeqBlocks over `pools` (one per cache group, `windows` their sliding
    windows), blocks of `block_size` tokens."""

    def __init__(
        self, pools: Mapping[str, BlockPool], block_size: int, windows: Mapping[str, int | None]
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pools = pools
        self.block_size = block_size
        self.windows = windows
        self.seqs: dict[int, SeqBlocks] = {}
        self._copies: list[BlockCopy] = []
        self.num_cow_copies = 0
        self.num_window_freed_blocks = 0

    def empty_state(self) -> SeqBlocks:
        return SeqBlocks(tables={group: [] for group in self.pools})

    # ------------------------------------------------------------------ allocation

    def plan(self, seq: Sequence, num_new_tokens: int) -> AllocationPlan:
        """What allocate(seq, num_new_tokens) would take, per group."""
        state = self.seqs.get(seq.seq_id)
        tables = state.tables if state else {}
        if num_new_tokens <= 0:
            return {group: (0, []) for group in self.pools}
        start = seq.num_computed_tokens
        first, last = start // self.block_size, (start + num_new_tokens - 1) // self.block_size
        plan = {}
        for group in self.pools:
            table = tables.get(group, [])
            held = table[first] if first < len(table) else None
            cow = int(held is not None and (held.ref_count > 1 or held.owner is not None))
            new = [i for i in range(first, last + 1) if i >= len(table) or table[i] is None]
            plan[group] = (cow, new)
        return plan

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks allocating seq's next `num_new_tokens` would take now, in the group needing
        most (new blocks plus copy-on-write copies)."""
        plan = self.plan(seq, num_new_tokens)
        return max((cow + len(new) for cow, new in plan.values()), default=0)

    def num_held(self, seq: Sequence, group: str) -> int:
        """Blocks seq holds in `group` (its KV footprint there)."""
        state = self.seqs.get(seq.seq_id)
        return 0 if state is None else sum(block is not None for block in state.tables[group])

    def pages_needed(self, plan: AllocationPlan) -> dict[PagePool, int]:
        """The pages a plan takes from each page pool (groups sharing one add up)."""
        needed: dict[PagePool, int] = {}
        for group, (cow, new) in plan.items():
            pool = self.pools[group]
            pages = (cow + len(new)) * pool.pages_per_block
            needed[pool.page_pool] = needed.get(pool.page_pool, 0) + pages
        return needed

    def allocate(self, seq: Sequence, plan: AllocationPlan) -> None:
        """Carry out `plan` (which must fit): new blocks lazily, and, when the block the first
        new token lands in is shared (another holder, or cached), seq's own copy of it with a
        BlockCopy queued for take_block_copies()."""
        state = self.seqs.setdefault(seq.seq_id, self.empty_state())
        first = seq.num_computed_tokens // self.block_size
        for group, (cow, new) in plan.items():
            pool, table = self.pools[group], state.tables[group]
            if cow:
                src = table[first]
                assert src is not None  # plan() copies only a block seq holds
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

    def release(self, state: SeqBlocks) -> None:
        """Drop every reference `state` holds, deepest first: leaves are reclaimed before
        their parents."""
        for group, table in state.tables.items():
            pool = self.pools[group]
            for block in reversed(table):
                if block is not None:
                    pool.decref(block)

    def drop(self, state: SeqBlocks, index: int) -> None:
        """Release logical block `index` in every group (an eviction policy's victim)."""
        for group, table in state.tables.items():
            block = table[index] if index < len(table) else None
            if block is not None:
                self.pools[group].decref(block)
                table[index] = None

    def free_out_of_window(self, state: SeqBlocks, num_computed: int) -> None:
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

    def take_block_copies(self) -> list[BlockCopy]:
        """Copy-on-write copies queued since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def take_page_assignments(self) -> list[Block]:
        """Blocks of several pages allocated since the last call, in order: the runner maps
        their pages before the next forward."""
        return [block for pool in self.pools.values() for block in pool.take_assignments()]

    # ------------------------------------------------------------------ addressing

    def layout(self, seq: Sequence) -> dict[str, list[tuple[int, int]]]:
        """Per group, the blocks seq holds as (physical block id, logical block index), in
        logical order. Blocks dropped by a sliding window or an eviction policy are absent."""
        state = self.seqs.get(seq.seq_id)
        if state is None:
            return {group: [] for group in self.pools}
        return {
            group: [(b.block_id, index) for index, b in enumerate(table) if b is not None]
            for group, table in state.tables.items()
        }

    def slots_for_new_tokens(self, seq: Sequence, num_new_tokens: int) -> dict[str, list[int]]:
        """Per group, the slot of each position in [num_computed_tokens, + num_new_tokens):
        the slot_mapping rows of this step. The positions must have been allocated."""
        state = self.seqs[seq.seq_id]
        start, bs = seq.num_computed_tokens, self.block_size
        out: dict[str, list[int]] = {}
        for group, table in state.tables.items():
            slots = []
            for pos in range(start, start + num_new_tokens):
                block = table[pos // bs]
                assert block is not None, f"position {pos} of seq {seq.seq_id} is not allocated"
                slots.append(block.block_id * bs + pos % bs)
            out[group] = slots
        return out

    # ------------------------------------------------------------------ capacity

    def max_blocks_per_sequence(self, primary: str) -> int:
        """The most `primary`-group blocks one sequence can hold alone: what bounds its
        context. With shared pages, the other groups' blocks of such a sequence take pages
        too (a sliding group's at most its window)."""
        pool = self.pools[primary]
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
