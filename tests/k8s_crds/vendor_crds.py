"""Take one version's schema out of a CustomResourceDefinition, for tests/test_deploy_k8s.py:

    python -m tests.k8s_crds.vendor_crds PATH/TO/crd.yaml VERSION

Writes tests/k8s_crds/<kind>.<group>.<version>.json: that version's openAPIV3Schema,
unchanged, as JSON. Note where the CRD came from (repository, tag, commit) in SOURCE.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent


def schema_path(kind: str, api_version: str) -> Path:
    """Where the vendored schema of `kind` in `api_version` ("group/version") lies."""
    group, _, version = api_version.partition("/")
    return HERE / f"{kind.lower()}.{group}.{version}.json"


def main() -> None:
    crd_path, version = sys.argv[1:]
    crd = yaml.safe_load(Path(crd_path).read_text())
    spec = crd["spec"]
    (entry,) = (v for v in spec["versions"] if v["name"] == version)
    target = schema_path(spec["names"]["kind"], f"{spec['group']}/{version}")
    target.write_text(json.dumps(entry["schema"]["openAPIV3Schema"], separators=(",", ":")) + "\n")
    print(target)


if __name__ == "__main__":
    main()
