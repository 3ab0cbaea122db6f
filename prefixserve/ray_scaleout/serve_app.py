"""``prefixserve serve --replicas N`` on Ray Serve: N engine replicas behind prefix-affinity ingresses.

Each replica is its own deployment (``replica-0`` ... ``replica-{N-1}``, one Ray Serve replica each),
so the router addresses a replica by a name that survives its restarts: Ray Serve places each one
(a GPU or a tensor-parallel group each; a CPU process on a CPU machine), calls its health check and
restarts it when its engine died. The ingress deployment (``--ingress-replicas`` Ray Serve replicas
of it, ``default_ingress_replicas``) serves the OpenAI routes and routes with
``serve_ingress.IngressCore``. This is the only module that imports Ray Serve (the ``[ray]`` extra);
a single server never does.
"""

# no `from __future__ import annotations`: Ray Serve's class-based routes need real annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.cors import allow_origins, read_origins
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.prepare import OpenAIContext
from prefixserve.ray_scaleout.placement import check_gpus, replica_cpu_share, wait_placed
from prefixserve.ray_scaleout.router import RoutingPolicy
from prefixserve.ray_scaleout.serve_ingress import IngressCore, ReplicaSet
from prefixserve.ray_scaleout.serve_replica import EngineReplica

try:
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("prefixserve serve --replicas needs Ray Serve: pip install 'prefixserve[ray]'") from exc

log = logging.getLogger(__name__)

APP_NAME = "prefixserve"
MAX_ONGOING = 4096  # Ray Serve's default (5) would queue a replica's requests in front of its scheduler

api = FastAPI(title="prefixserve replicas", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> Response:
    from fastapi.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status)


@serve.deployment(name="ingress", max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    """The OpenAI endpoint in front of the replicas (``default_ingress_replicas`` of it by default)."""

    def __init__(
        self,
        config: EngineConfig,
        policy: RoutingPolicy | None,
        *replicas: Any,
        allowed_origins: list[str] | None = None,
    ) -> None:
        from prefixserve.model.loader import tokenizer_for

        allow_origins(api, allowed_origins)  # before this process's app serves its first request

        model, tokenizer = tokenizer_for(config.model, progress=False, chat_template=config.chat_template)
        names = config.served_model_name or (model,)  # as the replicas' engines name it
        ctx = OpenAIContext(
            model=names[0],
            tokenizer=tokenizer,
            system_prompts=dict(config.system_prompts),
            aliases=names[1:],
            trust_request_chat_template=config.trust_request_chat_template,
            cache_salt_scope=config.cache_salt_scope,
        )
        handles = {f"replica-{i}": h for i, h in enumerate(replicas)}
        self.core = IngressCore(ReplicaSet(handles, policy), ctx, config.block_size)

    @api.get("/health")
    async def health(self) -> Response:
        return await self.core.health()

    @api.get("/metrics")
    async def metrics(self) -> Response:
        return await self.core.metrics()

    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        return await self.core.forward(request)  # ``path`` is in ``request`` too

    async def check_health(self) -> None:
        self.core.replicas.ensure_polling()  # Serve calls this on the replica's loop: start polling early


ReplicaDeployment = serve.deployment(
    name="replica",
    max_ongoing_requests=MAX_ONGOING,
    health_check_period_s=2.0,
    health_check_timeout_s=60.0,
    graceful_shutdown_timeout_s=5.0,
    logging_config={"enable_access_log": False},  # the ingress polls each replica 4 times a second
)(EngineReplica)


def replica_resources(
    config: EngineConfig, cpus: float | None = None, gpus: float | None = None
) -> dict[str, Any]:
    """Ray resources of one replica: a GPU per tensor-parallel rank when the engine runs on CUDA, else
    ``cpus`` (1 by default) of a CPU machine."""
    if gpus is None:
        wants_cuda = config.device.startswith("cuda")
        if config.device == "auto":
            import ray

            wants_cuda = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        gpus = float(config.tensor_parallel_size) if wants_cuda else 0.0
    return {"num_cpus": 1.0 if cpus is None else cpus, "num_gpus": gpus}


def default_ingress_replicas(replicas: int, on_gpu: bool) -> int:
    """Ingresses when none is asked for: one per engine replica on GPUs (at least 2), else 1.

    Every streamed token crosses an ingress (a Ray Serve item from the replica, relayed to the
    proxy) on one Python event loop: a single ingress relaying all of a GPU engine's streams is one
    of the two causes issue 52 found for ``--replicas 1`` streaming 46% fewer tokens/s than a direct
    server on an H100, and N GPU engines make N times the tokens. A CPU engine makes far fewer tokens
    than one ingress relays, and each ingress is a process (a tokenizer, the index) that would take
    memory and a core from the engines. More ingresses cost little otherwise (each polls every
    replica 4 times a second), but each sees only its own requests' loads and sessions."""
    return max(2, replicas) if on_gpu else 1


ENGINE_PROCESS_CHOICES = ("auto", "on", "off")


def serve_app(
    config: EngineConfig | None = None,
    replicas: int = 2,
    *,
    api_key: str | Sequence[str] | None = None,
    policy: RoutingPolicy | None = None,
    replica_cpus: float | None = None,
    replica_gpus: float | None = None,
    overload: Any = None,
    engine_process: str = "auto",
    ingress_replicas: int | None = None,
    switch_interval_ms: float | None = None,
    max_stored_responses: int = 1024,
    allowed_origins: list[str] | None = None,
    batches: Any = None,
) -> Any:
    """The Ray Serve application: ``serve.run(serve_app(config, replicas=2), route_prefix="/")``.

    ``overload``: each replica's ``OverloadSettings`` (its own queue bounds; None: the defaults);
    ``engine_process``: where each replica runs its engine, as ``serve --engine-process`` (auto: its
    own process on CUDA); ``ingress_replicas``: None: ``default_ingress_replicas``;
    ``switch_interval_ms``: each replica process's GIL switch interval (None: Python's);
    ``max_stored_responses``: each replica's bound on the /v1/responses it keeps;
    ``allowed_origins``: the browser origins the ingress answers (CORS); ``batches``: the replicas'
    ``BatchSettings`` (each keeps its files and batches in a folder of its own under ``files_dir``)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if ingress_replicas is not None and ingress_replicas < 1:
        raise ValueError(f"ingress_replicas must be >= 1, got {ingress_replicas}")
    if engine_process not in ENGINE_PROCESS_CHOICES:
        raise ValueError(
            f"engine_process must be one of {', '.join(ENGINE_PROCESS_CHOICES)}, got {engine_process!r}"
        )
    config = config or EngineConfig()
    read_origins(allowed_origins)  # a bad origin refused here, not in each ingress's process
    resources = replica_resources(config, replica_cpus, replica_gpus)
    if ingress_replicas is None:
        ingress_replicas = default_ingress_replicas(replicas, resources["num_gpus"] > 0)
    bound = [
        ReplicaDeployment.options(name=f"replica-{i}", ray_actor_options=resources).bind(
            config,
            api_key,
            overload,
            engine_process,
            switch_interval_ms,
            f"replica-{i}",
            max_stored_responses,
            batches,
        )
        for i in range(replicas)
    ]
    ingress = Ingress.options(num_replicas=ingress_replicas)
    return ingress.bind(config, policy, *bound, allowed_origins=allowed_origins)


def run_replicas(
    config: EngineConfig,
    replicas: int,
    host: str,
    port: int,
    api_key: str | Sequence[str] | None = None,
    replica_cpus: float | None = None,
    overload: Any = None,
    policy: RoutingPolicy | None = None,
    engine_process: str = "auto",
    ingress_replicas: int | None = None,
    switch_interval_ms: float | None = None,
    max_stored_responses: int = 1024,
    allowed_origins: list[str] | None = None,
    batches: Any = None,
) -> int:
    """``prefixserve serve --replicas N``: start Ray (or join a running cluster), serve until Ctrl-C."""
    import signal

    import ray

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM shuts Serve down as Ctrl-C does

    signal.signal(signal.SIGTERM, stop)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": host, "port": port})
    try:
        gpus = replica_resources(config, replica_cpus)["num_gpus"]
        if ingress_replicas is None:
            ingress_replicas = default_ingress_replicas(replicas, gpus > 0)
        available = ray.available_resources()
        replica_cpus = replica_cpu_share(replicas, ingress_replicas, replica_cpus, available.get("CPU", 0.0))
        if gpus > 0:
            check_gpus(replicas, gpus, available.get("GPU", 0.0))
        app = serve_app(
            config,
            replicas,
            api_key=api_key,
            policy=policy,
            replica_cpus=replica_cpus,
            overload=overload,
            engine_process=engine_process,
            ingress_replicas=ingress_replicas,
            switch_interval_ms=switch_interval_ms,
            max_stored_responses=max_stored_responses,
            allowed_origins=allowed_origins,
            batches=batches,
        )
        _deploy(app)
        log.info(
            "serving %d replicas of %s (%.2f CPUs each) behind %d ingresses on http://%s:%d",
            replicas,
            config.model or "the default model",
            replica_cpus,
            ingress_replicas,
            host,
            port,
        )
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


def _deploy(app: Any) -> None:
    """``serve.run`` of the application, its wait for placement bounded (``placement.wait_placed``:
    Ray Serve alone would wait forever for replicas it cannot place)."""
    import threading

    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
            outcome["error"] = None
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    threading.Thread(target=run, name="serve-deploy", daemon=True).start()
    wait_placed(serve.status, APP_NAME, lambda: "error" in outcome)
    if outcome["error"] is not None:
        raise outcome["error"]


__all__ = [
    "APP_NAME",
    "Ingress",
    "ReplicaDeployment",
    "default_ingress_replicas",
    "replica_resources",
    "run_replicas",
    "serve_app",
]
