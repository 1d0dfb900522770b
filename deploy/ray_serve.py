"""N engine replicas behind one OpenAI-compatible endpoint, on Ray Serve (Ray 2.60).

    serve run deploy.ray_serve:app replicas=2      # Ray Serve's CLI: HTTP on 127.0.0.1:8000
    python -m app serve --replicas 2               # the same from our CLI, on HOST:PORT

Each replica (a Ray actor) builds our own Litestar app and its engine in-process, with the
settings the builder read once (`load_settings()`: environment and `.env`), and is the
deployment's ASGI ingress: Ray Serve's HTTP proxy hands it every request, SSE stream and
WebSocket as ASGI, so routes, streaming, errors and auth are the single server's. Ray 2.60's
`@serve.ingress` takes any ASGI app, not only FastAPI; called without one, it asks the class's
`__serve_build_asgi_app__` on the replica, which is where the model is loaded.

- Routing: AffinityRouter, Ray Serve's request-router extension, applies deploy/routing.py's
  policy (sessions, then prompt prefixes, then load). The keys come from the body, which the
  proxy has not read when it routes: `deploy.proxy:proxy_middlewares`, installed in the
  proxy through RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, reads them first. The builder sets
  that variable, which reaches the proxy of a Ray instance started after it (`serve run`,
  `python -m app serve`); an existing cluster needs it in its own environment. Without it the
  router still routes sessions by X-Session-Id, the header the proxy puts in the request's
  metadata, and everything else by load.
- Fairness across replicas: VTC counters shared through a ledger deployment (deploy/fairness.py).
- Metrics: each replica serves /metrics, /api/metrics, /health and /live on its own port,
  `ops_port` + its rank on its node, to be scraped one target per replica (Prometheus sums
  them); the shared endpoint's /metrics is the view of whichever replica it was routed to.
- A replica that dies fails only the requests in flight on it, each with an OpenAI error (the
  proxy middleware's doing, deploy/proxy.py); the router stops choosing it and Serve's
  controller starts a replacement.
- Threads: a replica gets `num_cpus` of the machine and that many OpenMP threads (at least 1).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Literal

import structlog
import uvicorn
from pydantic import BaseModel, Field
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deploy.fairness import ServedSince, ServiceLedger, Usage
from deploy.routing import ROUTE_SCOPE_KEY, AffinityPolicy, RouteKeys

if TYPE_CHECKING:  # the proxy imports this module for the router: no torch there
    from litestar import Litestar

    from app.server import ServerState
    from app.settings import Settings
    from engine.async_engine import AsyncEngine

log = structlog.get_logger(__name__)

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "deploy.proxy:proxy_middlewares"
SHARE_EVERY_S = 0.5  # how often a replica exchanges service with the ledger
# Ray Serve's cap on one replica's requests in flight, streams and open WebSockets included:
# far above what the engine admits, so that its own queue limit (429) is the backpressure.
MAX_ONGOING_REQUESTS = 4096


class ScaleOutArgs(BaseModel):
    """The application's arguments (`serve run deploy.ray_serve:app replicas=2 ...`)."""

    replicas: int = Field(2, ge=1)
    num_cpus: float | None = Field(None, gt=0)  # per replica; None: the machine's cores / replicas
    ops_port: int | None = Field(None, ge=0)  # replica r's ops port is this + r; None: PORT + 1
    router: Literal["affinity", "power_of_two"] = "affinity"  # power_of_two: Ray's default
    share_fairness: bool = True


def _route_keys(request: PendingRequest | None) -> RouteKeys:
    """The keys RouteKeysMiddleware put in the request's scope. Ray's HTTP proxy calls the
    replica with one argument, the request pickled as a StreamingHTTPRequest: its ASGI scope
    (the body follows, pulled by the replica once routed). Without the middleware: the
    X-Session-Id the proxy copies into the request's metadata."""
    if request is None:
        return RouteKeys()
    if request.args and isinstance(request.args[0], bytes):
        try:
            keys = pickle.loads(request.args[0]).asgi_scope.get(ROUTE_SCOPE_KEY)
        except Exception:
            keys = None
        if isinstance(keys, RouteKeys):
            return keys
    return RouteKeys(request.metadata.session_id or None)


class AffinityRouter(RequestRouter):
    """deploy/routing.py's AffinityPolicy as a Ray Serve request router. It runs in each
    proxy (and in each process holding a handle), so each keeps its own tables; a session's
    fallback hash is the same in all of them."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`request_router_kwargs`: AffinityPolicy's arguments."""
        self._policy = AffinityPolicy(**kwargs)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replicas = {r.replica_id.unique_id: r for r in candidate_replicas}
        reported = {name: r.routing_stats.get("queued", 0) for name, r in replicas.items()}
        ranks = self._policy.rank(_route_keys(pending_request), reported)
        if pending_request is not None and ranks:
            # When every rank is full, back off between attempts instead of spinning.
            pending_request.routing_context.should_backoff = True
            self._policy.aim(pending_request.metadata.internal_request_id, ranks[0][0])
        return [[replicas[name] for name in rank] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._policy.record(_route_keys(pending_request), replica_id.unique_id)
        self._policy.aim(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._policy.done(internal_request_id)


class Ledger:
    """The one ServiceLedger the replicas exchange service through (deploy/fairness.py)."""

    def __init__(self) -> None:
        self._ledger = ServiceLedger()

    def exchange(self, replica: str, served: Usage) -> Usage:
        return self._ledger.exchange(replica, served, time.monotonic())


class GemmaReplica:
    """One engine replica: our Litestar app as the ingress, its ops port, its share of VTC."""

    def __init__(
        self, settings: Settings, ops_port: int | None, ledger: DeploymentHandle | None
    ) -> None:
        self._settings = settings
        self._ops_port = ops_port
        self._ledger = ledger
        self._state: ServerState | None = None
        self._ops: uvicorn.Server | None = None
        self._tasks: list[asyncio.Task] = []

    def __serve_build_asgi_app__(self) -> Litestar:
        from app.main import create_app

        app = create_app(self._settings)  # loads the model; exits the replica if it cannot
        app.on_startup.append(self._started)
        app.on_shutdown.append(self._stopped)
        return app

    async def _started(self, app: Litestar) -> None:
        """After the app's lifespan started the engine."""
        self._state = state = app.state.server
        context = serve.get_replica_context()
        if self._ops_port is not None:
            self._ops = uvicorn.Server(
                uvicorn.Config(
                    _ops_app(state), host=self._settings.HOST,
                    port=self._ops_port + context.rank.local_rank, lifespan="off",
                    log_config=None, log_level="warning", access_log=False,
                )
            )  # fmt: skip
            self._tasks.append(asyncio.create_task(self._ops.serve()))
        if self._ledger is not None and self._settings.SCHEDULING_POLICY == "vtc":
            self._tasks.append(asyncio.create_task(self._share(state.engine, context.replica_tag)))

    async def _stopped(self) -> None:
        """After the app's lifespan drained the engine."""
        if self._ops is not None:
            self._ops.should_exit = True
        for task in self._tasks:
            task.cancel()

    async def _share(self, engine: AsyncEngine, replica: str) -> None:
        """Exchange service with the ledger every SHARE_EVERY_S (deploy/fairness.py)."""
        assert self._ledger is not None
        served = ServedSince()
        while True:
            await asyncio.sleep(SHARE_EVERY_S)
            delta = served.delta(engine.tenant_service())
            try:
                owed = await self._ledger.exchange.remote(replica, delta)
            except Exception as exc:  # the ledger restarting: this round is not shared
                log.warning("service exchange failed", error=repr(exc))
                continue
            engine.charge_remote(owed)

    def record_routing_stats(self) -> dict[str, float]:
        """What routers see as `replica.routing_stats`: the engine's queued work."""
        if self._state is None:
            return {}
        return {"queued": self._state.engine.num_queued}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died is restarted."""
        if self._state is not None and not self._state.engine.is_alive:
            raise RuntimeError("the engine loop has stopped")


# Deployments made by call, not as class decorators: type checkers keep a decorated class's type.
LEDGER = serve.deployment(
    name="service-ledger",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},  # two calls a second per replica
)(Ledger)
ENGINE = serve.deployment(
    name="gemma", max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=5
)(serve.ingress()(GemmaReplica))


def _ops_app(state: ServerState) -> Litestar:
    """The replica's own operational routes, over the same state as its app."""
    from litestar import Litestar
    from litestar.datastructures import State

    from app import routes_ops
    from app.errors import EXCEPTION_HANDLERS

    return Litestar(
        route_handlers=routes_ops.ROUTES,
        state=State({"server": state}),
        exception_handlers=EXCEPTION_HANDLERS,
        openapi_config=None,
    )


def build_app(args: ScaleOutArgs, settings: Settings) -> Application:
    """The Serve application: `args.replicas` engine replicas (and the service ledger)."""
    # Before any Ray instance starts here, so that its proxy inherits it.
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    cpus = args.num_cpus or (os.cpu_count() or 1) / args.replicas
    options: dict[str, Any] = {
        "num_replicas": args.replicas,
        "ray_actor_options": {
            "num_cpus": cpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(cpus)))}},
        },
        # Room for the app's own drain (SHUTDOWN_GRACE_S) when Serve stops a replica.
        "graceful_shutdown_timeout_s": settings.SHUTDOWN_GRACE_S + 10,
    }
    if args.router == "affinity":
        options["request_router_config"] = {
            "request_router_class": AffinityRouter,
            "request_routing_stats_period_s": 1,
        }
    ops_port = settings.PORT + 1 if args.ops_port is None else args.ops_port
    ledger = LEDGER.bind() if args.share_fairness else None
    return ENGINE.options(**options).bind(settings, ops_port or None, ledger)


def app(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder (`serve run deploy.ray_serve:app key=value ...`): the
    CLI's strings validated into ScaleOutArgs here, as Ray hands a builder a plain dict unless
    its parameter is annotated with the model class itself."""
    from app.settings import load_settings

    return build_app(ScaleOutArgs.model_validate(args), load_settings())


def serve_forever(args: ScaleOutArgs, settings: Settings) -> None:
    """`python -m app serve --replicas N`: start a local Ray instance, run the application
    with HTTP on HOST:PORT, and stop it all (replicas drain first) on SIGINT or SIGTERM."""
    import ray

    from app.logging import configure_logging

    configure_logging(settings.LOG_FORMAT)
    application = build_app(args, settings)  # before ray.init: see build_app
    ray.init(address="local", include_dashboard=False)
    try:
        serve.start(http_options={"host": settings.HOST, "port": settings.PORT})
        serve.run(application, blocking=False)
        log.info(
            "serving", host=settings.HOST, port=settings.PORT, replicas=args.replicas,
            router=args.router,
        )  # fmt: skip
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        serve.shutdown()
    finally:
        ray.shutdown()
