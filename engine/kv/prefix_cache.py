"""The prefix cache: which computed KV blocks can be reused by later sequences.

Two structures over the same blocks:
- a radix tree over token ids at block granularity, one tree per cache salt (sequences
  with different salts never share). Every node is one full block: its key is the block's
  `block_size` token ids and it holds the block of each cache group that has it (always
  the primary group's; a sliding group's block may be missing). Because every edge is
  exactly one block, two prompts that diverge inside a block branch at the node before it:
  the tree never needs an edge split, and partial blocks are never shared through it.
- an exact-match index: (salt, whole prompt) -> the prompt's deepest node plus, when the
  prompt ends mid-block, that partial block, so a repeated prompt is found with one lookup
  and reuses everything but its last token.

The cache holds no references. Blocks it owns stay cached when their holders release
them; the block pools reclaim them least-recently-released first and call forget_block().
Losing a node's primary block drops the node and its subtree (their blocks that are still
held stay with their holders, uncached); losing a sliding block only removes it from its
node. Sequences release their blocks deepest-first and every match re-takes the whole
path, so the reclaimed block is a leaf unless an eviction policy released an inner block.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_pool import Block, BlockPool


class RadixNode:
    """One full block of tokens under its parent's prefix (the root of a salt has no block)."""

    __slots__ = ("blocks", "children", "detached", "exact_keys", "key", "parent", "salt")

    def __init__(self, key: tuple[int, ...], parent: RadixNode | None, salt: str | None) -> None:
        self.key = key
        self.parent = parent
        self.salt = salt
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.blocks: dict[str, Block] = {}  # cache group -> the block holding this key's K/V
        self.exact_keys: set[tuple] = set()  # exact-match entries that point here
        self.detached = False  # dropped from the tree (a holder may still reference it)

    def path(self) -> list[RadixNode]:
        """Nodes from the first block down to this one (the root excluded)."""
        nodes = []
        node = self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


class ExactEntry:
    """A whole prompt: its K/V for the first num_tokens tokens is in node's path, then tail."""

    __slots__ = ("key", "node", "num_tokens", "tail")

    def __init__(
        self, key: tuple, node: RadixNode, num_tokens: int, tail: dict[str, Block] | None
    ) -> None:
        self.key = key
        self.node = node
        self.num_tokens = num_tokens
        self.tail = tail  # group -> the prompt's partial last block, owned by this entry


@dataclass
class PrefixMatch:
    """A cached prefix: num_tokens tokens, and per group the blocks covering them by logical
    index (None where a sliding group does not need the block)."""

    num_tokens: int
    tables: dict[str, list[Block | None]]
    nodes: list[RadixNode]  # radix path of the matched full blocks
    exact: bool  # found through the exact-match index


class PrefixCache:
    def __init__(
        self,
        pools: dict[str, BlockPool],
        primary: str,
        block_size: int,
        windows: dict[str, int | None],
    ) -> None:
        self.pools = pools
        self.primary = primary
        self.block_size = block_size
        self.windows = windows
        self.roots: dict[str | None, RadixNode] = {}
        self._exact: dict[tuple, ExactEntry] = {}
        self.num_nodes = 0
        self.num_evicted_nodes = 0
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_exact_hits = 0

    def root(self, salt: str | None) -> RadixNode:
        """The tree of one cache salt, created on first use."""
        node = self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = RadixNode((), None, salt)
        return node

    # ------------------------------------------------------------------ lookup

    def match(
        self, token_ids: list[int], salt: str | None, exact_prompt: list[int] | None = None
    ) -> PrefixMatch:
        """The longest reusable prefix of token_ids, leaving at least the last token to compute.

        exact_prompt: the prompt, when token_ids is exactly the prompt; tried in the
        exact-match index first. A prefix of length L is usable only if the primary group
        (and any full-attention group) has every block of [0, L) and each sliding group has
        the blocks covering [max(0, L - window), L). Counts one query in the statistics.
        """
        self.num_queries += 1
        self.num_query_tokens += len(token_ids)
        limit = len(token_ids) - 1
        result = None
        if limit > 0 and exact_prompt is not None:
            entry = self._exact.get((salt, tuple(exact_prompt)))
            if entry is not None:
                nodes = entry.node.path()
                length = min(entry.num_tokens, limit)
                tables = self._tables(nodes, entry.tail, length)
                if tables is not None:
                    result = PrefixMatch(length, tables, nodes, exact=True)
                    self.num_exact_hits += 1
        if result is None and limit > 0:
            nodes = self._walk(token_ids, salt)
            length = min(len(nodes) * self.block_size, limit)
            while length > 0:
                tables = self._tables(nodes, None, length)
                if tables is not None:
                    result = PrefixMatch(length, tables, nodes, exact=False)
                    break
                # Next candidate: the block boundary below.
                length = (-(-length // self.block_size) - 1) * self.block_size
        if result is None:
            result = PrefixMatch(0, {g: [] for g in self.pools}, [], exact=False)
        self.num_hit_tokens += result.num_tokens
        return result

    def _walk(self, token_ids: list[int], salt: str | None) -> list[RadixNode]:
        """Radix nodes of the longest run of token_ids' full blocks found in the tree."""
        node = self.roots.get(salt)
        nodes: list[RadixNode] = []
        if node is None:
            return nodes
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            node = node.children.get(tuple(token_ids[start : start + bs]))
            if node is None:
                break
            nodes.append(node)
        return nodes

    def _tables(
        self, nodes: list[RadixNode], tail: dict[str, Block] | None, length: int
    ) -> dict[str, list[Block | None]] | None:
        """Per group, the blocks a sequence needs to continue from `length` cached tokens,
        or None if some needed block is not cached."""
        num_blocks = -(-length // self.block_size)
        tables: dict[str, list[Block | None]] = {}
        for group in self.pools:
            window = self.windows[group]
            first = 0 if window is None else max(0, length - window) // self.block_size
            table: list[Block | None] = [None] * num_blocks
            for index in range(first, num_blocks):
                if index < len(nodes):
                    block = nodes[index].blocks.get(group)
                else:
                    block = tail.get(group) if tail is not None and index == len(nodes) else None
                if block is None:
                    return None
                table[index] = block
            tables[group] = table
        return tables

    # ------------------------------------------------------------------ insertion

    def insert(
        self, parent: RadixNode, key: tuple[int, ...], blocks: dict[str, Block]
    ) -> RadixNode:
        """The child of parent for one full block of tokens, created if missing.

        blocks: the inserting sequence's block per group (held, so ref_count > 0). A new node
        takes ownership of them; an existing node adopts only blocks of groups it lacks. The
        caller compares node.blocks with its own to switch to the already cached copies.
        """
        node = parent.children.get(key)
        if node is None:
            if self.primary not in blocks:
                raise ValueError("a new radix node needs a block of the primary group")
            node = parent.children[key] = RadixNode(key, parent, parent.salt)
            self.num_nodes += 1
        for group, block in blocks.items():
            if group not in node.blocks and block.owner is None:
                self.pools[group].own(block, node)
                node.blocks[group] = block
        return node

    def register_exact(
        self,
        salt: str | None,
        prompt: list[int],
        node: RadixNode,
        num_tokens: int,
        tail: dict[str, Block] | None,
    ) -> bool:
        """Index a whole prompt whose first num_tokens tokens are cached in node's path
        (then tail, whose blocks the entry takes ownership of). Keeps an existing entry
        that covers at least as many tokens; returns whether the new one was stored."""
        key = (salt, tuple(prompt))
        old = self._exact.get(key)
        if old is not None:
            if old.num_tokens >= num_tokens:
                return False
            self._drop_entry(old)
        entry = ExactEntry(key, node, num_tokens, tail)
        if tail is not None:
            for group, block in tail.items():
                self.pools[group].own(block, entry)
        node.exact_keys.add(key)
        self._exact[key] = entry
        return True

    # ------------------------------------------------------------------ reclamation

    def forget_block(self, block: Block) -> None:
        """A pool is reusing this cached block: drop whatever points at it."""
        owner = block.owner
        if isinstance(owner, RadixNode):
            if block.group == self.primary:
                self._remove_subtree(owner)
            else:
                del owner.blocks[block.group]
                self.pools[block.group].disown(block)
        elif isinstance(owner, ExactEntry):
            self._drop_entry(owner)

    def _remove_subtree(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None  # a root holds no block, so it is never reclaimed
        del parent.children[node.key]
        stack = [node]
        while stack:
            current = stack.pop()
            current.detached = True
            stack.extend(current.children.values())
            for key in list(current.exact_keys):
                self._drop_entry(self._exact[key])
            for group, block in current.blocks.items():
                self.pools[group].disown(block)
            current.blocks = {}
            self.num_nodes -= 1
            self.num_evicted_nodes += 1
        self._prune_root(parent)

    def _drop_entry(self, entry: ExactEntry) -> None:
        del self._exact[entry.key]
        entry.node.exact_keys.discard(entry.key)
        if entry.tail is not None:
            for group, block in entry.tail.items():
                self.pools[group].disown(block)
            entry.tail = None
        self._prune_root(entry.node)

    def _prune_root(self, node: RadixNode) -> None:
        """Forget an empty salt tree, so one-off salts do not accumulate."""
        if (
            node.parent is None
            and not node.children
            and not node.exact_keys
            and self.roots.get(node.salt) is node
        ):
            del self.roots[node.salt]

    # ------------------------------------------------------------------ views

    def exact_entries(self) -> dict[tuple, ExactEntry]:
        """The exact-match index: key -> entry."""
        return dict(self._exact)

    @property
    def num_exact_entries(self) -> int:
        return len(self._exact)

    def stats(self) -> dict:
        return {
            "queries": self.num_queries,
            "query_tokens": self.num_query_tokens,
            "hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / max(1, self.num_query_tokens),
            "exact_hits": self.num_exact_hits,
            "nodes": self.num_nodes,
            "exact_entries": len(self._exact),
            "evicted_nodes": self.num_evicted_nodes,
        }
