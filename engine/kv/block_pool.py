"""A fixed set of KV blocks for one cache group: refcounted, with LRU reuse of cached blocks.

Every block is in exactly one of three states:
- in use:  ref_count > 0 (held by one or more sequences' block tables);
- cached:  ref_count == 0 but owned by the prefix cache, so its K/V may be matched again;
- free:    ref_count == 0 and unowned, waiting in the free queue.
Cached blocks count as available: when the free queue is empty, the least recently released
cached block is reclaimed (its owner is told to forget it first) and handed out again.
So `num_available` is exact: free + cached, and it returns to `num_total` whenever no
sequence holds a block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class Block:
    """One physical block of `block_size` token slots in one cache group."""

    __slots__ = ("block_id", "group", "owner", "ref_count")

    def __init__(self, block_id: int, group: str) -> None:
        self.block_id = block_id
        self.group = group
        self.ref_count = 0
        self.owner: object | None = None  # the prefix-cache structure that caches this block

    def __repr__(self) -> str:
        cached = self.owner is not None
        return f"Block({self.group}#{self.block_id}, ref={self.ref_count}, cached={cached})"


class NoFreeBlocksError(RuntimeError):
    """allocate() was called with nothing free or reclaimable; callers check num_available first."""


class BlockPool:
    """The blocks of one cache group, ids 0..num_blocks-1."""

    def __init__(self, group: str, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.group = group
        self.blocks = [Block(i, group) for i in range(num_blocks)]
        self._free: deque[Block] = deque(self.blocks)
        # Cached blocks nobody holds, least recently released first.
        self._cached: OrderedDict[int, Block] = OrderedDict()
        # Called with a cached block about to be reused; must make its owner forget it
        # (through disown) so no cache structure points at recycled memory.
        self.reclaim_handler: Callable[[Block], None] | None = None
        self.num_reclaimed = 0

    @property
    def num_total(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks in the free queue (not cached)."""
        return len(self._free)

    @property
    def num_cached_unused(self) -> int:
        """Cached blocks with no holder: reusable, reclaimed LRU when the free queue is empty."""
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free + cached-unused."""
        return len(self._free) + len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self.num_total - self.num_available

    def reclaim_order(self) -> list[int]:
        """Ids of cached-unused blocks in the order they would be reclaimed."""
        return list(self._cached)

    def allocate(self) -> Block:
        """A block with ref_count 1 and no owner: from the free queue, else the LRU cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            _, block = self._cached.popitem(last=False)
            if self.reclaim_handler is not None:
                self.reclaim_handler(block)
            if block.owner is not None:
                raise RuntimeError(f"reclaimed {block!r} is still owned")
            self.num_reclaimed += 1
        else:
            raise NoFreeBlocksError(f"no free {self.group} blocks")
        block.ref_count = 1
        return block

    def incref(self, block: Block) -> None:
        """Another holder; a cached-unused block stops being reclaimable."""
        if block.ref_count == 0:
            if block.owner is None:
                raise RuntimeError(f"incref of free {block!r}")
            del self._cached[block.block_id]
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        """One holder fewer; at zero the block becomes cached-unused (if owned) or free."""
        if block.ref_count <= 0:
            raise RuntimeError(f"decref of unheld {block!r}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.owner is not None:
                self._cached[block.block_id] = block  # most recently released goes last
            else:
                self._free.append(block)

    def own(self, block: Block, owner: object) -> None:
        """The prefix cache takes ownership of a held block (it stays cached when released)."""
        if block.owner is not None:
            raise RuntimeError(f"{block!r} already has an owner")
        if block.ref_count == 0:
            raise RuntimeError(f"only a held block can become cached: {block!r}")
        block.owner = owner

    def disown(self, block: Block) -> None:
        """The prefix cache forgets a block; if nobody holds it, it returns to the free queue.

        A block currently being reclaimed is already out of the cached set and is left alone.
        """
        block.owner = None
        if block.ref_count == 0 and self._cached.pop(block.block_id, None) is not None:
            self._free.append(block)
