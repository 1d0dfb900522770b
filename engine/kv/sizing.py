"""How many KV blocks each cache group gets out of one memory budget.

A sliding-window layer never needs more than its window of keys per sequence (the KV manager
frees older blocks), while a full-attention layer needs the whole context. Splitting the budget
evenly, the same number of blocks for every group, leaves most of the sliding pools idle once
contexts outgrow the window (Gemma 3: 5 of 6 layers slide over 512 tokens). So:

- a sliding group gets what its window can use: for every sequence that may run at once
  (max_num_seqs), the window's blocks plus two (one partly outside the window, one the next
  token opens), plus the blocks of one step's prefill chunks (max_num_batched_tokens); never
  more than the even split would give it, since then the full-attention pool runs out first;
- full-attention groups share the rest of the bytes.

Every count is a pool size only: admission still checks each group's own free blocks, so a
workload that outruns one pool waits or is preempted rather than failing.

That split is fixed at startup for MAX_BATCH_SIZE sequences. When the storing layers' K/V
widths divide one another (Gemma 3: one shape; Gemma 4: full-attention layers twice or half as
wide as sliding ones), the groups share one pool of pages instead (SharedPages, as vLLM's
hybrid allocator does): a page is one block of a few lanes, each as wide as the widest layer;
a narrower layer takes part of a lane, a block of a group takes as many pages as its layers
fill, and each group takes pages as its sequences need them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from engine.kv.layout import CacheGroupSpec, SharedPages, layer_width


def can_share_pages(groups: SequenceOf[CacheGroupSpec]) -> bool:
    """Whether the groups' layers can share pages: more than one group, each of one layer
    shape, every layer's width dividing the widest (then a lane holds whole layers)."""
    if len(groups) < 2 or any(group.layer_shape is None for group in groups):
        return False
    widths = [layer_width(group) for group in groups]
    return all(max(widths) % width == 0 for width in widths)


def lanes_per_page(lane_slots: SequenceOf[int]) -> int:
    """Lanes a page has, given the lanes one block of each group fills: the most that leave
    the fewest lanes unused on a group's last page (a page of fewer lanes means more pages
    per block, so more slot mappings per step). At most the smallest group's count, so
    that no block of it has an empty page."""
    return min(
        range(1, min(lane_slots) + 1),
        key=lambda lanes: (sum(-(-n // lanes) * lanes - n for n in lane_slots), -lanes),
    )


def shared_pages(
    groups: SequenceOf[CacheGroupSpec],
    budget_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_context_tokens: int | None = None,
) -> SharedPages:
    """The page pool `budget_bytes` of KV memory makes for groups that can_share_pages.

    Lanes are as wide as the widest layer, and as many a page as lanes_per_page says (Gemma 3:
    3 layers; its 15 sliding layers take 5 pages a block, no lane unused).
    max_context_tokens caps the pool at what max_num_seqs sequences of that many tokens in all
    could ever hold, as in blocks_per_group.
    """
    lane_width = max(layer_width(group) for group in groups)
    one_lane = SharedPages(0, 1, lane_width)  # a block's pages then count its lane slots
    lanes = lanes_per_page([one_lane.pages_per_block(group) for group in groups])
    first = groups[0]
    element_bytes = first.bytes_per_token // (2 * len(first.layer_ids) * layer_width(first))
    page_bytes = lanes * 2 * lane_width * element_bytes * block_size
    layout = SharedPages(max(1, budget_bytes // page_bytes), lanes, lane_width)
    largest = max(layout.pages_per_block(group) for group in groups)
    num_pages = max(largest, layout.num_pages)
    if max_context_tokens is not None:
        ceiling = 0
        for group in groups:
            if group.sliding_window is None:
                blocks = -(-max_context_tokens // block_size)
            else:
                blocks = sliding_blocks_needed(
                    group.sliding_window, block_size, max_num_seqs, max_num_batched_tokens
                )
            ceiling += blocks * layout.pages_per_block(group)
        num_pages = max(largest, min(num_pages, ceiling))
    return SharedPages(num_pages, lanes, lane_width)


def even_split(groups: SequenceOf[CacheGroupSpec], budget_bytes: int, block_size: int) -> int:
    """Blocks per group when every group gets the same number (the layout before sizing by
    layer kind, kept for comparison): the budget over one block of every group."""
    block_bytes = sum(group.bytes_per_token for group in groups) * block_size
    return max(1, budget_bytes // max(block_bytes, 1))


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks one sequence holds in a sliding group: the window's, plus one partly
    outside it and one the next token opens."""
    return -(-window // block_size) + 2


def sliding_blocks_needed(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """The most blocks a sliding group with `window` can hold at once (see the module doc)."""
    per_sequence = window_blocks(window, block_size)
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)


def blocks_per_group(
    groups: SequenceOf[CacheGroupSpec],
    budget_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_context_tokens: int | None = None,
) -> dict[str, int]:
    """Blocks for each cache group from `budget_bytes` of KV memory.

    max_context_tokens caps a full-attention group at the tokens it could ever hold (every
    running sequence at the model's maximum length), so an automatic budget does not reserve
    memory nobody can use.
    """
    even = even_split(groups, budget_bytes, block_size)
    sizes: dict[str, int] = {}
    spent = 0
    for group in groups:
        if group.sliding_window is not None:
            needed = sliding_blocks_needed(
                group.sliding_window, block_size, max_num_seqs, max_num_batched_tokens
            )
            sizes[group.name] = min(even, needed)
            spent += sizes[group.name] * group.bytes_per_token * block_size
    full = [group for group in groups if group.sliding_window is None]
    if full:
        full_block_bytes = sum(group.bytes_per_token for group in full) * block_size
        blocks = max(1, (budget_bytes - spent) // max(full_block_bytes, 1))
        if max_context_tokens is not None:
            blocks = min(blocks, max(1, -(-max_context_tokens // block_size)))
        sizes.update({group.name: blocks for group in full})
    return sizes
