"""Cut OpenAI's OpenAPI spec down to the component schemas the tests validate against.

    python -m tests.openai_spec.vendor_spec PATH/TO/openapi.yaml

Writes `tests/openai_spec/openapi-subset.json`: the spec's `info` block and every component schema
reachable by `$ref` from ROOTS, unchanged. Run it again when moving to a newer spec and note the
source commit in tests/openai_spec/SOURCE.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "CompletionUsage",
    "ErrorResponse",
    "ListModelsResponse",
    "Model",
    "CreateResponse",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
)
SUBSET_PATH = Path(__file__).with_name("openapi-subset.json")
_PREFIX = "#/components/schemas/"


def _refs(node: Any) -> set[str]:
    """Names of the component schemas `node` refers to directly."""
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].removeprefix(_PREFIX)} if "$ref" in node else set()
    return found.union(*(_refs(value) for value in node.values()))


def subset(spec: dict[str, Any], roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    schemas = spec["components"]["schemas"]
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(_refs(schemas[name]) - keep)
    return {
        "openapi": spec["openapi"],
        "info": spec["info"],
        "components": {"schemas": {name: schemas[name] for name in sorted(keep)}},
    }


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(sys.argv[1]) as f:
        spec = yaml.load(f, Loader=loader)
    trimmed = subset(spec)
    SUBSET_PATH.write_text(json.dumps(trimmed, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {SUBSET_PATH} ({len(trimmed['components']['schemas'])} schemas)")


if __name__ == "__main__":
    main()
