"""deploy/Dockerfile's own steps, run here without Docker (no Docker engine on this machine):
the file is read instruction by instruction, with its ARG and ENV values substituted as Docker
does, its COPYs taken from the repository through .dockerignore, and its RUN commands run in
order with /bin/sh, in a fresh venv and with nothing from this checkout's .venv; then its CMD
serves, its HEALTHCHECK must pass, and the official openai client gets a completion.

Two build args are set, as `docker build --build-arg` sets them: PREFIX, the image's
/opt/gemma-serve, points into a temporary directory; TORCH_PIP_ARGS is emptied, because
download.pytorch.org is unreachable here: pip then finds `torch==2.13.0+cpu` through this
machine's own pip configuration (its local wheels). The `system` stage's RUNs (adding the
user, apt packages) are not run: they change the machine. So not tested here: that index URL,
the `system` stage, and running as the user 10001 (every step runs as this test's user).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from app.settings import Settings
from tests.conftest import MODEL_ID, ROOT, free_port

pytestmark = pytest.mark.slow

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ROOT_ONLY_STAGE = "system"


@dataclass
class Image:
    """What the emulated build leaves: the runtime's environment, directory, user, commands."""

    env: dict[str, str]
    workdir: Path
    user: str = "root"
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # the root-only stage's RUNs


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuations joined, comment lines dropped (Docker
    drops them inside a continued instruction too)."""
    result, pending = [], []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            keyword, _, rest = " ".join(pending).partition(" ")
            result.append((keyword.upper(), rest.strip()))
            pending = []
    return result


def substitute(value: str, variables: dict[str, str]) -> str:
    """Docker's $NAME / ${NAME} substitution; unset names become empty."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], ""), value)


def _pattern(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/"))
    wildcard = {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wildcard.get(part, re.escape(part)) for part in parts))


def ignored(relative: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last pattern matching the path or one of its parents decides."""
    parents = relative.split("/")
    prefixes = ["/".join(parents[: i + 1]) for i in range(len(parents))]
    result = False
    for pattern in patterns:
        regex = _pattern(pattern.removeprefix("!"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            result = not pattern.startswith("!")
    return result


def copy_from_context(sources: list[str], dest: Path) -> None:
    """COPY from the build context (the repository) as Docker does: a directory's contents, or
    files into the directory `dest`; a source that matches nothing fails the build."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for source in sources:
        copied = 0
        for match in sorted(ROOT.glob(source)):
            files = (
                sorted(p for p in match.rglob("*") if p.is_file()) if match.is_dir() else [match]
            )
            for file in files:
                if ignored(file.relative_to(ROOT).as_posix(), patterns):
                    continue
                target = dest / (file.relative_to(match) if match.is_dir() else file.name)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, target)
                copied += 1
        assert copied, f"COPY {source}: nothing in the build context"


def build(build_args: dict[str, str], scratch: Path, log: Path) -> Image:
    """Run the Dockerfile's instructions; returns the final stage's image."""
    base_env = {
        k: v
        for k, v in os.environ.items()
        if k not in Settings.__struct_fields__
        and k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    # The base image's python: this interpreter's own installation, not .venv.
    base_env["PATH"] = f"{Path(sys.base_prefix) / 'bin'}{os.pathsep}{base_env['PATH']}"
    global_args: dict[str, str] = {}
    declared: set[str] = set()
    stages: dict[str, tuple[dict[str, str], Path, str]] = {}  # what a stage built on inherits
    stage, args, env, workdir, user = "", global_args, {}, scratch, "root"
    image = Image(env={}, workdir=scratch)
    for keyword, rest in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            base, _, stage = substitute(rest, global_args).partition(" AS ")
            if base in stages:
                env, workdir, user = dict(stages[base][0]), stages[base][1], stages[base][2]
            else:  # an image: its PATH is where the base python is
                env, workdir, user = {"PATH": base_env["PATH"]}, scratch, "root"
            args = {}
        elif keyword == "ARG":  # in a stage, a bare ARG NAME takes the global default
            name, has_default, default = rest.partition("=")
            declared.add(name)
            fallback = "".join(shlex.split(default)) if has_default else global_args.get(name, "")
            args[name] = build_args.get(name, fallback)
        elif keyword == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                env[name] = substitute(value, args | env)
        elif keyword == "WORKDIR":
            workdir = workdir / substitute(rest, args | env)
            workdir.mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            words = [substitute(word, args | env) for word in shlex.split(rest)]
            if words[0].startswith("--from="):  # one filesystem for every stage here
                assert words[1] == words[2], words
            else:
                copy_from_context(words[:-1], workdir / words[-1])
        elif keyword == "USER":
            user = rest
        elif keyword == "RUN" and stage == ROOT_ONLY_STAGE:
            image.skipped.append(rest)
        elif keyword == "RUN":
            with log.open("a") as out:
                out.write(f"\n$ {rest}\n")
                out.flush()
                done = subprocess.run(
                    ["/bin/sh", "-c", rest], cwd=workdir, env=base_env | args | env,
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            assert done.returncode == 0, f"RUN {rest}\n{log.read_text()[-4000:]}"
        elif keyword == "HEALTHCHECK":
            image.healthcheck = json.loads(rest.partition(" CMD ")[2])
        elif keyword == "CMD":
            image.cmd = json.loads(rest)
        else:
            assert keyword == "EXPOSE", f"{keyword}: not emulated; extend this test"
        stages[stage] = (env, workdir, user)
    assert set(build_args) <= declared, "a build arg the Dockerfile does not declare"
    # The final stage's; ARGs do not reach the container.
    image.env, image.workdir, image.user = base_env | env, workdir, user
    return image


def healthy(image: Image, env: dict[str, str], deadline: float) -> bool:
    """Run the HEALTHCHECK until it passes (True) or the deadline passes (False)."""
    while time.monotonic() < deadline:
        if subprocess.run(image.healthcheck, env=env, capture_output=True).returncode == 0:
            return True
        time.sleep(1)
    return False


def test_the_cpu_image_builds_prepares_and_serves(tmp_path: Path) -> None:
    prefix = tmp_path / "opt"
    image = build({"PREFIX": str(prefix), "TORCH_PIP_ARGS": ""}, tmp_path, tmp_path / "build.log")
    assert image.user == "10001:10001"
    assert all("pip" not in run and "python" not in run for run in image.skipped), image.skipped
    cache = Path(image.env["GEMMA_SERVE_CACHE"])
    assert (cache / MODEL_ID / "model.safetensors").is_file() and not (cache / "gguf").exists()
    python = [str(prefix / "venv" / "bin" / "python"), "-c"]
    version = subprocess.run([*python, "import torch; print(torch.__version__)"],
                             env=image.env, capture_output=True, text=True, check=True)  # fmt: skip
    assert version.stdout.strip() == "2.13.0+cpu"
    # The RayService's import path resolves in the image (without importing Ray).
    spec = "import importlib.util as u; assert u.find_spec('deploy.ray_serve')"
    subprocess.run([*python, spec], env=image.env, cwd=image.workdir, check=True)

    port = free_port()
    env = image.env | {"HOST": "127.0.0.1", "PORT": str(port)}  # docker run -e HOST -e PORT
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            image.cmd, cwd=image.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        assert healthy(image, env, time.monotonic() + 120), log_path.read_text()
        base_url = f"http://127.0.0.1:{port}"
        assert httpx.get(base_url + "/live", timeout=10).status_code == 200
        client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(
            model=MODEL_ID, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert completion.choices[0].text.strip(), completion
    finally:
        server.terminate()  # SIGTERM, as `docker stop` sends it to PID 1
        status = server.wait(timeout=60)
    assert status == 0, log_path.read_text()
