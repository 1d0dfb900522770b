"""How long a full garbage collection stalls the server, with its startup objects frozen (as
served, engine.host_memory.freeze_startup_objects) and without.

    python -m evals.gc_pause [--repeats 5]

Builds the server's state in this process as `python -m app serve` does (app.server:
settings from the environment, the model loaded, the engine thread started, the startup
objects frozen), then times full collections (gc.collect(), every generation) while they are
frozen, unfreezes them and times the same again. A full collection holds the GIL for its whole
walk, so the engine thread, and every stream with it, waits that long.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

from app.server import build_server_state
from app.settings import load_settings
from evals.harness import write_results


def full_collection_ms(repeats: int) -> list[float]:
    """Milliseconds of `repeats` full collections in a row."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - start))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    state = build_server_state(load_settings(), created=int(time.time()))
    try:
        frozen = gc.get_freeze_count()
        tracked_frozen = len(gc.get_objects())
        with_freeze = full_collection_ms(args.repeats)
        gc.unfreeze()
        tracked = len(gc.get_objects())
        without = full_collection_ms(args.repeats)
    finally:
        asyncio.run(state.engine.shutdown())
    rows = [
        ("startup objects frozen (as served)", tracked_frozen, with_freeze),
        ("nothing frozen", tracked, without),
    ]
    lines = [
        "| | objects a full collection walks | full collection, ms (median) | max |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {walked:,} | {statistics.median(ms):.1f} | {max(ms):.1f} |"
        for name, walked, ms in rows
    ]
    markdown = "\n".join(lines)
    print(f"{frozen:,} objects frozen at startup; {args.repeats} full collections each")
    print(markdown)
    path = write_results(
        "gc_pause",
        {"frozen_objects": frozen, "repeats": args.repeats,
         "full_collection_ms": {"frozen": with_freeze, "unfrozen": without},
         "walked_objects": {"frozen": tracked_frozen, "unfrozen": tracked},
         "markdown": markdown},
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
