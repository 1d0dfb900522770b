"""The engine's pure logic stands apart: the KV bookkeeping (engine.kv) and the scheduler
(engine.sched) import and run without torch, and no engine module imports itself back
through others, counting imports under TYPE_CHECKING and inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BLOCK_TORCH = """
import importlib.abc, sys

class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked")
        return None

sys.meta_path.insert(0, BlockTorch())
import pkgutil, engine.kv, engine.sched
for package in (engine.kv, engine.sched):
    for module in pkgutil.iter_modules(package.__path__):
        __import__(f"{package.__name__}.{module.name}")
assert "torch" not in sys.modules
"""


def test_kv_and_sched_import_without_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_kv_and_sched_run_without_torch() -> None:
    """A request admitted, prefilled and decoded through the scheduler and the KV manager."""
    script = (
        BLOCK_TORCH
        + """
from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.request import Sequence
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from engine.sched.scheduler import Scheduler

groups = [CacheGroupSpec("full", (0,), None, 64)]
kv = KVCacheManager(groups, {"full": 8}, block_size=4)
scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), kv)
seq = Sequence(list(range(6)), SamplingParams(max_tokens=2))
scheduler.add(seq)
plan = scheduler.schedule()
assert [(s.seq, s.start, s.num_new_tokens) for s in plan.scheduled] == [(seq, 0, 6)]
assert kv.num_free_blocks == 8 - 2  # 6 tokens in blocks of 4
"""
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _imports(path: Path) -> set[str]:
    """The engine modules a file imports anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "engine")
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_in_engine() -> None:
    graph = {_module_name(path): _imports(path) for path in (ROOT / "engine").rglob("*.py")}
    cycles: list[list[str]] = []
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
