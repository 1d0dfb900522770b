"""`python -m app serve [--host H] [--port P]`: the same server as `uvicorn app.main:app`."""

from __future__ import annotations

import argparse

import uvicorn

from app.main import create_app
from app.settings import load_settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--host", help="bind address (default: HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: PORT or 8000)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("HOST", args.host), ("PORT", args.port)) if v is not None}
    settings = load_settings(**overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.HOST,
        port=settings.PORT,
        log_level="info",
        # In-flight streams get the grace period, then are cancelled (which aborts them).
        timeout_graceful_shutdown=int(settings.SHUTDOWN_GRACE_S),
    )


if __name__ == "__main__":
    main()
