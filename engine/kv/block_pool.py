"""Refcounted KV blocks carved from pages of memory, with LRU reuse of cached blocks.

A page is `block_size` token slots of a few lanes of K/V (engine.kv.layout.SharedPages). A block
of a cache group takes `pages_per_block` pages: one when the group has a page space of its own,
more when groups share one (Gemma 3's 15 sliding layers take 5 pages of 3 layers, its 3
full-attention layers one). Sharing lets the groups trade memory as the workload needs,
instead of a split fixed at startup.

Every block is in exactly one of three states:
- in use:  ref_count > 0 (held by one or more sequences' block tables);
- cached:  ref_count == 0 but owned by the prefix cache, so its K/V may be matched again;
- free:    ref_count == 0 and unowned: its pages are back in the page pool's free queue.
Cached blocks count as available: when the free pages are too few, the least recently released
cached block of any group in the page pool is reclaimed (its owner is told to forget it first)
and its pages handed out again. So `num_available` is exact, and it returns to `num_total`
whenever no sequence holds a block.

A block's id is its first page, unique among live blocks; the model runner maps a multi-page
block's other pages from the assignments the pool records (take_assignments).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping

from engine.kv.layout import CacheGroupSpec, SharedPages


class Block:
    """One block of `block_size` token slots in one cache group, on `pages`."""

    __slots__ = ("block_id", "group", "owner", "pages", "ref_count")

    def __init__(self, pages: tuple[int, ...], group: str) -> None:
        self.pages = pages
        self.block_id = pages[0]
        self.group = group
        self.ref_count = 0
        self.owner: object | None = None  # the prefix-cache structure that caches this block

    def __repr__(self) -> str:
        cached = self.owner is not None
        return f"Block({self.group}#{self.block_id}, ref={self.ref_count}, cached={cached})"


class NoFreeBlocksError(RuntimeError):
    """allocate() was called with nothing free or reclaimable; callers check num_available first."""


class PagePool:
    """Pages 0..num_pages-1: a free queue, and the cached blocks on them of every group."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        # Cached blocks nobody holds, of every group here, least recently released first.
        self._cached: OrderedDict[Block, BlockPool] = OrderedDict()
        self.num_cached_pages = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages that can be handed out now: free, or under a cached block nobody holds."""
        return len(self._free) + self.num_cached_pages

    def stats(self) -> dict[str, int]:
        return {"total": self.num_pages, "free": self.num_free, "cached": self.num_cached_pages}

    def free_pages(self) -> list[int]:
        """The free queue's pages, in order."""
        return list(self._free)

    def take(self, count: int) -> tuple[int, ...]:
        """`count` pages, reclaiming cached blocks least recently released first if needed."""
        if count > self.num_available:
            raise NoFreeBlocksError(f"{count} pages wanted, {self.num_available} available")
        while len(self._free) < count:
            block, pool = self._cached.popitem(last=False)
            self.num_cached_pages -= len(block.pages)
            pool.reclaim(block)
        return tuple(self._free.popleft() for _ in range(count))

    def release(self, pages: tuple[int, ...]) -> None:
        self._free.extend(pages)

    def cache(self, block: Block, pool: BlockPool) -> None:
        self._cached[block] = pool  # most recently released goes last
        self.num_cached_pages += len(block.pages)

    def uncache(self, block: Block) -> bool:
        """Take a cached block out of the reclaimable set; False if it was not in it."""
        if self._cached.pop(block, None) is None:
            return False
        self.num_cached_pages -= len(block.pages)
        return True

    def cached_blocks(self) -> list[Block]:
        """Cached blocks nobody holds, in the order they would be reclaimed."""
        return list(self._cached)


class BlockPool:
    """The blocks of one cache group over `pages` (its own page pool of num_blocks pages, or
    one shared with other groups), each block `pages_per_block` pages."""

    def __init__(
        self,
        group: str,
        num_blocks: int | None = None,
        pages: PagePool | None = None,
        pages_per_block: int = 1,
    ) -> None:
        if pages is None:
            if num_blocks is None or num_blocks < 1:
                raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
            pages = PagePool(num_blocks * pages_per_block)
        if pages_per_block < 1 or pages.num_pages < pages_per_block:
            raise ValueError(f"{pages.num_pages} pages cannot hold a block of {pages_per_block}")
        self.group = group
        self.page_pool = pages
        self.pages_per_block = pages_per_block
        self.live: dict[int, Block] = {}  # block id -> the block, while held or cached
        self._num_cached = 0
        # Called with a cached block about to be reused; must make its owner forget it
        # (through disown) so no cache structure points at recycled memory.
        self.reclaim_handler: Callable[[Block], None] | None = None
        self.num_reclaimed = 0
        # Multi-page blocks handed out since take_assignments(): the runner maps their pages.
        self._assigned: list[Block] = []

    @property
    def num_total(self) -> int:
        return self.page_pool.num_pages // self.pages_per_block

    def stats(self) -> dict[str, int]:
        return {
            "total": self.num_total,
            "pages_per_block": self.pages_per_block,
            "in_use": self.num_in_use,
            "cached_unused": self.num_cached_unused,
            "free": self.num_free,
            "reclaimed": self.num_reclaimed,
        }

    @property
    def num_free(self) -> int:
        """Blocks the free pages make, without reclaiming anything."""
        return self.page_pool.num_free // self.pages_per_block

    @property
    def num_cached_unused(self) -> int:
        """This group's cached blocks with no holder: reusable, reclaimed LRU when needed."""
        return self._num_cached

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: from free pages and reclaimable cached blocks."""
        return self.page_pool.num_available // self.pages_per_block

    @property
    def num_in_use(self) -> int:
        """This group's blocks with a holder."""
        return len(self.live) - self._num_cached

    def reclaim_order(self) -> list[int]:
        """Ids of this group's cached-unused blocks in the order they would be reclaimed."""
        return [b.block_id for b in self.page_pool.cached_blocks() if b.group == self.group]

    def allocate(self) -> Block:
        """A block with ref_count 1 and no owner, on free pages or those of reclaimed blocks."""
        if self.num_available < 1:
            raise NoFreeBlocksError(f"no free {self.group} blocks")
        block = Block(self.page_pool.take(self.pages_per_block), self.group)
        block.ref_count = 1
        self.live[block.block_id] = block
        if self.pages_per_block > 1:
            self._assigned.append(block)
        return block

    def take_assignments(self) -> list[Block]:
        """Multi-page blocks allocated since the last call, in order."""
        assigned, self._assigned = self._assigned, []
        return assigned

    def incref(self, block: Block) -> None:
        """Another holder; a cached-unused block stops being reclaimable."""
        if block.ref_count == 0:
            if block.owner is None:
                raise RuntimeError(f"incref of free {block!r}")
            self.page_pool.uncache(block)
            self._num_cached -= 1
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        """One holder fewer; at zero the block becomes cached-unused (if owned) or free."""
        if block.ref_count <= 0:
            raise RuntimeError(f"decref of unheld {block!r}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.owner is not None:
                self.page_pool.cache(block, self)
                self._num_cached += 1
            else:
                self._release(block)

    def own(self, block: Block, owner: object) -> None:
        """The prefix cache takes ownership of a held block (it stays cached when released)."""
        if block.owner is not None:
            raise RuntimeError(f"{block!r} already has an owner")
        if block.ref_count == 0:
            raise RuntimeError(f"only a held block can become cached: {block!r}")
        block.owner = owner

    def disown(self, block: Block) -> None:
        """The prefix cache forgets a block; if nobody holds it, its pages are freed.

        A block currently being reclaimed is already out of the cached set and is left alone.
        """
        block.owner = None
        if block.ref_count == 0 and self.page_pool.uncache(block):
            self._num_cached -= 1
            self._release(block)

    def reclaim(self, block: Block) -> None:
        """The page pool reuses this cached block's pages (it is already out of the cached
        set): its owner forgets it, and the pages go back to the free queue."""
        self._num_cached -= 1
        if self.reclaim_handler is not None:
            self.reclaim_handler(block)
        if block.owner is not None:
            raise RuntimeError(f"reclaimed {block!r} is still owned")
        self.num_reclaimed += 1
        self._release(block)

    def _release(self, block: Block) -> None:
        del self.live[block.block_id]
        self.page_pool.release(block.pages)


def make_pools(
    groups: list[CacheGroupSpec], num_blocks: int | Mapping[str, int] | SharedPages
) -> dict[str, BlockPool]:
    """One block pool per cache group: all over one shared page pool, or each with pages of
    its own (`num_blocks` for every group, or per group)."""
    names = [g.name for g in groups]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"the KV cache needs distinctly named cache groups, got {names}")
    if isinstance(num_blocks, SharedPages):
        pages = PagePool(num_blocks.num_pages)
        return {
            g.name: BlockPool(g.name, pages=pages, pages_per_block=num_blocks.pages_per_block(g))
            for g in groups
        }
    sizes = num_blocks if isinstance(num_blocks, Mapping) else {g.name: num_blocks for g in groups}
    return {g.name: BlockPool(g.name, sizes[g.name]) for g in groups}
