"""Graceful shutdown under uvicorn: the server drains before uvicorn stops it.

Left to itself, uvicorn answers SIGTERM by closing its listening socket and every WebSocket at
once, cancels the streams still open after --timeout-graceful-shutdown (they stop mid-stream,
with no error event), and only then runs the lifespan's shutdown; once stopped it raises the
signal again, so the process dies of SIGTERM rather than exiting 0.

So the first SIGTERM (or SIGINT) starts a drain instead: the engine admits nothing new (new
generations get a 503 and /health turns 503, so load balancers stop sending, while /live
stays 200: the process is alive and finishing its work), in-flight requests get
SHUTDOWN_GRACE_S to finish, those still running then end with an error, and only then is
uvicorn's server asked to exit, which it does with status 0. A second signal goes to uvicorn's
own handler: stop without waiting for the drain.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType

import structlog
import uvicorn

from engine.async_engine import AsyncEngine

log = structlog.get_logger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainOnSignal:
    def __init__(self, engine: AsyncEngine, grace_s: float) -> None:
        self._engine = engine
        self._grace_s = grace_s
        self._draining = False
        self._task: asyncio.Task | None = None  # the drain (held: the loop keeps weak refs)

    def install(self) -> None:
        """Take SIGTERM and SIGINT over from uvicorn's server (call from the lifespan). Does
        nothing when uvicorn's handlers are not the ones installed (another server, or not the
        main thread): the lifespan's shutdown still drains, only later."""
        if threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGTERM)
        # uvicorn installs its Server's bound handle_exit with signal.signal (uvicorn.server).
        server = getattr(handler, "__self__", None)
        if not isinstance(server, uvicorn.Server) or not callable(handler):
            return
        self._server = server
        self._uvicorn_handler: Callable[[int, FrameType | None], object] = handler
        self._loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._draining:
            self._uvicorn_handler(signum, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(signum).name)

    def _start_drain(self, signal_name: str) -> None:
        self._task = self._loop.create_task(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        log.info("draining", signal=signal_name, grace_s=self._grace_s)
        cut = await self._engine.drain(self._grace_s)
        log.info("drained", cut_requests=cut)
        self._server.should_exit = True
