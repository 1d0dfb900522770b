"""`python -m app serve [--host H] [--port P]`: the same server as `uvicorn app.main:app`.

`python -m app serve --replicas N` serves N engine replicas behind one endpoint on HOST:PORT,
through a local Ray Serve instance (deploy/ray_serve.py; needs `ray[serve]`), until SIGINT or
SIGTERM; `--replicas 1` is one replica behind the same proxy and router.

`python -m app prepare` converts or downloads MODEL_NAME into the local cache, builds the fused
CPU kernels (engine/model/cpu_ops.py) on a CPU device, and exits, so a first server start (or a
test's readiness wait) does not include that one-time work.
"""

from __future__ import annotations

import argparse
import time

import structlog
import uvicorn

from app.logging import configure_logging
from app.main import create_app
from app.settings import load_settings
from engine.device import resolve_device
from engine.model import cpu_ops
from engine.model.loader import prepare_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--host", help="bind address (default: HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: PORT or 8000)")
    serve.add_argument("--replicas", type=int, help="engine replicas behind Ray Serve")
    serve.add_argument(
        "--replica-cpus", type=float, help="CPUs per replica (default: all cores / replicas)"
    )
    serve.add_argument(
        "--ops-port", type=int,
        help="replica r's /metrics, /health, /live: this port + r (default PORT + 1; 0: none)",
    )  # fmt: skip
    serve.add_argument(
        "--router", choices=("affinity", "power_of_two"), default="affinity",
        help="affinity: sessions, then prompt prefixes, then load; power_of_two: Ray's default",
    )  # fmt: skip
    serve.add_argument(
        "--fairness", choices=("shared", "local"), default="shared",
        help="shared: VTC counters count every replica's service; local: each its own",
    )  # fmt: skip
    commands.add_parser("prepare", help="convert or download MODEL_NAME into the cache, then exit")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare()
        return
    overrides = {k: v for k, v in (("HOST", args.host), ("PORT", args.port)) if v is not None}
    settings = load_settings(**overrides)
    if args.replicas is not None:
        from deploy.ray_serve import ScaleOutArgs, serve_forever

        scale = ScaleOutArgs(
            replicas=args.replicas, num_cpus=args.replica_cpus, ops_port=args.ops_port,
            router=args.router, share_fairness=args.fairness == "shared",
        )  # fmt: skip
        serve_forever(scale, settings)
        return
    uvicorn.run(
        create_app(settings),
        host=settings.HOST,
        port=settings.PORT,
        log_level="info",
        # A backstop: the drain (app/shutdown.py) has ended every generation by then; this
        # bounds the wait for clients that stopped reading.
        timeout_graceful_shutdown=int(settings.SHUTDOWN_GRACE_S) + 5,
    )


def prepare() -> None:
    settings = load_settings()
    configure_logging(settings.LOG_FORMAT)
    started = time.perf_counter()
    model_id, directory = prepare_model(settings.MODEL_NAME)
    log = structlog.get_logger(__name__)
    log.info(
        "model ready",
        model=model_id,
        path=str(directory),
        seconds=round(time.perf_counter() - started, 1),
    )
    if resolve_device(settings.DEVICE).type == "cpu":
        log.info("fused CPU kernels", available=cpu_ops.available())


if __name__ == "__main__":
    main()
