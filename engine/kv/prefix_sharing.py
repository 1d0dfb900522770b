"""Prefix sharing between sequences: publishing a sequence's computed blocks to the prefix
cache (radix tree and exact-match index) and starting a new sequence from the longest cached
prefix of its tokens."""

from __future__ import annotations

from engine.kv.block_pool import Block
from engine.kv.block_tables import BlockTables, SeqBlocks
from engine.kv.prefix_cache import PrefixCache
from engine.request import Sequence


class PrefixSharing:
    """Moves blocks between sequences' tables (`tables`) and the prefix `cache`."""

    def __init__(self, tables: BlockTables, cache: PrefixCache, primary: str) -> None:
        self.tables = tables
        self.cache = cache
        self.primary = primary
        self.block_size = tables.block_size

    def match(self, seq: Sequence, state: SeqBlocks) -> int:
        """Take references on the longest cached prefix of seq.token_ids under
        seq.cache_salt into `state` (exact-match index first for a sequence without output,
        then the radix tree) and return its length in tokens. The length is a multiple of the
        block size except when the cached blocks cover every token, or the exact-match index
        has the prompt's partial last block: then it is num_tokens - 1, because at least one
        token is always recomputed to get logits (the shared block it lands in is copied on
        write when allocated)."""
        exact_prompt = seq.prompt_token_ids if seq.num_output_tokens == 0 else None
        match = self.cache.match(seq.token_ids, seq.cache_salt, exact_prompt)
        for group, blocks in match.tables.items():
            for block in blocks:
                if block is not None:
                    self.tables.pools[group].incref(block)
            state.tables[group] = list(blocks)
        cached = match.num_tokens
        state.path = match.nodes[: cached // self.block_size]
        for group, window in self.tables.windows.items():
            if window is not None:
                state.window_start[group] = max(0, cached - window) // self.block_size
        return cached

    def publish(self, seq: Sequence, state: SeqBlocks) -> None:
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
            own = state.held_at(index)
            if self.primary not in own:
                break  # a single sliding group already dropped it: nothing to hang a node on
            node = self.cache.insert(parent, tuple(tokens[index * bs : (index + 1) * bs]), own)
            for group, block in own.items():
                cached = node.blocks.get(group)
                if cached is not None and cached is not block:
                    pool = self.tables.pools[group]
                    pool.incref(cached)
                    state.tables[group][index] = cached
                    pool.decref(block)
            state.path.append(node)
            parent = node

    def register_prompt(self, seq: Sequence, state: SeqBlocks, final: bool) -> None:
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
                own = state.held_at(full)
                if self.primary in own and all(
                    b.ref_count == 1 and b.owner is None for b in own.values()
                ):
                    tail, claim = own, prompt_len
        if claim > state.prompt_claim:
            # An entry already covering as much (another sequence's) also settles it.
            self.cache.register_exact(seq.cache_salt, seq.prompt_token_ids, node, claim, tail)
            state.prompt_claim = claim
