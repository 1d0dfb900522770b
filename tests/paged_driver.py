"""Test helpers: drive a backend the way the engine does (blocks, slots, ForwardBatch), and
build tiny random-weight Gemma models with transformers' own classes."""

from __future__ import annotations

import copy
import random

import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig
from transformers.initialization import no_init_weights

from engine.model.batch import ForwardBatch, GroupAttention
from engine.runner import ModelRunner


class PagedDriver:
    """A minimal block allocator plus ForwardBatch builder for one backend (run by a ModelRunner).

    Each sequence gets blocks per cache group; slot = block * block_size + offset. With
    `shuffle_blocks`, blocks come from a shuffled free list, so a sequence's keys are scattered
    over non-consecutive blocks. Sliding groups attend only to the keys the step's earliest
    query can still see (what transformers' sliding cache keeps).
    """

    def __init__(
        self,
        backend,
        num_blocks: int = 64,
        block_size: int = 4,
        shuffle_blocks: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        self.backend = backend
        self.block_size = block_size
        self.runner = ModelRunner(backend, num_blocks, block_size, kv_dtype)
        self.groups = {spec.name: spec.sliding_window for spec in self.runner.cache_groups}
        free = list(range(num_blocks))
        if shuffle_blocks is not None:
            random.Random(shuffle_blocks).shuffle(free)
        self.free = {name: list(free) for name in self.groups}
        self.blocks: dict[int, dict[str, list[int]]] = {}
        self.length: dict[int, int] = {}

    def _slot(self, seq: int, group: str, position: int) -> int:
        blocks = self.blocks[seq][group]
        while len(blocks) <= position // self.block_size:
            blocks.append(self.free[group].pop(0))
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def step(
        self,
        new_tokens: dict[int, list[int]],
        all_logits: bool = False,
        collect_attention: bool = False,
    ):
        """Run one forward over `new_tokens` per sequence id; returns ({seq: logits}, output)."""
        ids, positions, query_start, logits_rows, owners = [], [], [0], [], []
        slot_mapping = {name: [] for name in self.groups}
        keys = {name: [] for name in self.groups}
        for seq, tokens in new_tokens.items():
            if seq not in self.blocks:
                self.blocks[seq] = {name: [] for name in self.groups}
                self.length[seq] = 0
            start = self.length[seq]
            new_positions = list(range(start, start + len(tokens)))
            for name, window in self.groups.items():
                slot_mapping[name] += [self._slot(seq, name, p) for p in new_positions]
                first = 0 if window is None else max(0, start - window + 1)
                keys[name].append(
                    [(self._slot(seq, name, p), p) for p in range(first, start + len(tokens))]
                )
            rows = range(len(ids), len(ids) + len(tokens))
            ids += tokens
            positions += new_positions
            query_start.append(len(ids))
            chosen = list(rows) if all_logits else [rows[-1]]
            logits_rows += chosen
            owners += [(seq, len(chosen))]
            self.length[seq] = start + len(tokens)
        groups = {}
        for name in self.groups:
            width = max(len(row) for row in keys[name])
            pad = [(0, -1, False)]
            rows = [[(s, p, True) for s, p in row] + pad * (width - len(row)) for row in keys[name]]
            groups[name] = GroupAttention(
                slot_mapping=torch.tensor(slot_mapping[name]),
                key_slots=torch.tensor([[s for s, _, _ in row] for row in rows]),
                key_positions=torch.tensor([[p for _, p, _ in row] for row in rows]),
                key_valid=torch.tensor([[v for _, _, v in row] for row in rows]),
            )
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            query_start=query_start,
            groups=groups,
            logits_indices=torch.tensor(logits_rows),
            collect_attention=collect_attention,
        )
        out = self.runner.forward(batch)
        result, row = {}, 0
        for seq, count in owners:
            result[seq] = out.logits[row : row + count]
            row += count
        return result, out


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter and persistent buffer random, norm weights and layer scalars included
    (their defaults of 0 or 1 would hide bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("layer_scalar"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif "norm" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5 + 0.5)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.15)
    return model


def hf_model(config, seed: int | None = None, state_dict: dict | None = None):
    """transformers' CausalLM for `config` in float32 with eager attention: random weights from
    `seed`, or `state_dict`."""
    model_class = Gemma4ForCausalLM if isinstance(config, Gemma4TextConfig) else Gemma3ForCausalLM
    config = copy.deepcopy(config)  # transformers records the attention choice on the config
    with no_init_weights():
        model = model_class._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.tie_weights()  # skipped with the weight init
    if state_dict is None:
        randomize_(model, seed)
    else:
        model.load_state_dict(state_dict, strict=False)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int, **kwargs) -> list[torch.Tensor]:
    """Next-token logits after the prompt and after each of `steps` greedy tokens, computed by
    transformers with its own DynamicCache."""
    cache = DynamicCache(config=model.config)
    # The last row's logits only, given as an index: an int would also make Gemma 4 skip the
    # other rows in its KV-shared layers, which changes the float rounding.
    last = torch.tensor([len(prompt) - 1])
    logits = model(
        torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=last, **kwargs
    ).logits[0, -1]
    out = [logits]
    for _ in range(steps):
        token = torch.tensor([[int(logits.argmax())]])
        logits = model(token, cache=cache, use_cache=True, **kwargs).logits[0, -1]
        out.append(logits)
    return out


def engine_greedy(
    driver: PagedDriver,
    prompts: dict[int, list[int]],
    steps: int,
    joins: dict[int, dict[int, list[int]]] | None = None,
) -> dict[int, list[torch.Tensor]]:
    """Greedy decoding of several sequences batched together; `joins[step]` adds sequences
    (prefilled in that step, next to the others' decodes). Returns per sequence the logits
    after its prompt and after each of its greedy tokens."""
    history: dict[int, list[torch.Tensor]] = {}
    pending, joins, step = dict(prompts), dict(joins or {}), 0
    while pending or joins:
        pending.update(joins.pop(step, {}))
        step += 1
        if not pending:
            continue
        logits, _ = driver.step(pending)
        pending = {}
        for seq, rows in logits.items():
            history.setdefault(seq, []).append(rows[-1])
            if len(history[seq]) <= steps:
                pending[seq] = [int(rows[-1].argmax())]
    return history
