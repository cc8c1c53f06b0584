"""specdecode on Ray Serve: engine replicas behind one OpenAI-compatible ingress.

    specdecode serve --model smollm2-135m --replicas 2                      # a local Ray instance
    specdecode serve --model smollm2-135m --replicas 2 --ray-address auto   # a running cluster

The application is three deployments:

- `EngineReplica` (`--replicas` of them, or autoscaled between `--min-replicas` and
  `--max-replicas`): one `LLM` and its engine on a thread (`AsyncEngine`), with the CPUs (or GPU)
  Ray reserves for it. `generate` streams one request's deltas; every half second it reports its
  counters to the board and takes the aborts the board holds for it.
- `Ingress` (one): the very FastAPI application of `specdecode serve` (`create_app`), over a
  `ReplicaClient` that sends each engine request to a replica through a deployment handle. It
  loads the tokenizer, not the weights.
- `MetricsBoard` (one): the replicas' latest counters, which the ingress's `/metrics` renders
  labelled by replica, and the aborts the ingress asks of each replica.

Requests reach replicas through `PrefixRouter` (a Ray Serve request router over
`routing.choose`): the replica that was sent the longest prefix of the prompt's KV blocks, else the
least busy. A replica that dies is replaced by Ray Serve; the requests it was running end with a
503 error (`EngineStopped`), never a hang. A stream the ingress closes early (a stop string, a
failed choice, or a client that disconnects: Ray Serve's proxy then cancels the ingress's
handler) has its request aborted on the replica that holds it (named by the stream's first item),
freeing its blocks: through the board, because cancelling a Ray Serve streaming response does not
reach the replica's generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from specdecode.distributed.routing import PrefixTable, block_hashes, choose
from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest, EngineStats, RequestDelta
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.models.loader import resolve_model
from specdecode.serving.async_engine import AsyncEngine, DeltaStream, EngineStopped
from specdecode.serving.server import Frontend, create_app

APP_NAME = "specdecode"
REPORT_S = 0.5  # how often a replica sends its counters to the board (and takes its aborts)
STALE_S = 15.0  # a replica silent this long is left out of /metrics (it died)
# Environment the replicas need from the launching process (model cache, kernel choice; their
# thread counts come from ServeSettings.threads).
FORWARDED_ENV = ("SPECDECODE_", "HF_")


@dataclass(frozen=True)
class ServeSettings:
    """What `specdecode serve --replicas` deploys, validated in one place. `threads`: CPU threads
    of each replica (Ray reserves as many CPUs for it); `gpus`: GPUs of each replica (device
    "cuda"). Autoscaling is on when `min_replicas` or `max_replicas` is given."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "auto"
    quantization: str | None = None
    activations: str = "float32"
    device: str | None = None
    threads: int = 1
    gpus: float = 0.0
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    api_key: str | None = None
    model_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("threads", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecDecodeError(f"{name} must be a positive integer, got {value!r}")
        low = self.replicas if self.min_replicas is None else self.min_replicas
        high = self.replicas if self.max_replicas is None else self.max_replicas
        if not 0 <= low <= self.replicas <= high:
            raise SpecDecodeError(
                f"replicas must satisfy min_replicas <= replicas <= max_replicas, "
                f"got {low} <= {self.replicas} <= {high}"
            )
        if self.gpus < 0:
            raise SpecDecodeError(f"gpus must be >= 0, got {self.gpus}")

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        if self.min_replicas is None and self.max_replicas is None:
            return None
        return {
            "min_replicas": self.replicas if self.min_replicas is None else self.min_replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.replicas if self.max_replicas is None else self.max_replicas,
            "target_ongoing_requests": max(1, self.engine.max_num_seqs // 2),
        }


# ---- the replicas -------------------------------------------------------------------------------


@serve.deployment(ray_actor_options={"num_cpus": 0})
class MetricsBoard:
    """The latest counters each replica reported, by replica name; the aborts asked of each."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, EngineStats]] = {}
        self.aborts: dict[str, list[str]] = {}

    def report(self, replica: str, stats: EngineStats) -> list[str]:
        """Keep `stats`; return the request ids `replica` is to abort."""
        self.reports[replica] = (time.monotonic(), stats)
        return self.aborts.pop(replica, [])

    def abort(self, replica: str, request_id: str) -> None:
        self.aborts.setdefault(replica, []).append(request_id)

    def snapshot(self) -> dict[str, EngineStats]:
        now = time.monotonic()
        self.reports = {k: v for k, v in self.reports.items() if now - v[0] < STALE_S}
        self.aborts = {k: v for k, v in self.aborts.items() if k in self.reports}  # dead: dropped
        return {k: stats for k, (_, stats) in self.reports.items()}


@serve.deployment
class EngineReplica:
    """One engine. `generate` yields the replica's name once the engine accepted the request (so
    bad input fails before any delta, and the ingress knows where to send an abort), then the
    request's deltas."""

    async def __init__(self, settings: ServeSettings, board: DeploymentHandle) -> None:
        llm = LLM(
            model=settings.model,
            dtype=settings.dtype,
            quantization=settings.quantization,
            activations=settings.activations,
            device=settings.device,
            speculative=settings.engine.speculative,
            num_threads=settings.threads,
            progress=False,
        )
        self.engine = AsyncEngine(llm.new_engine(settings.engine))
        self.engine.start()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self._reporter = asyncio.get_running_loop().create_task(self._report())

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestDelta | str]:
        stream = await self.engine.generate(req)
        yield self.name
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield delta

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    async def _report(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the board restarting: report next time
                for request_id in await self.board.report.remote(self.name, self.engine.stats):
                    self.engine.abort(request_id)  # its client left
            await asyncio.sleep(REPORT_S)

    def __del__(self) -> None:
        self.engine.shutdown(timeout=5.0)


class PrefixRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request router for `EngineReplica`: `routing.choose` over the replicas' queue
    lengths as Ray last measured them."""

    def initialize_state(self, block_size: int = 16, imbalance: int = 8) -> None:
        self.block_size = block_size
        self.imbalance = imbalance
        self.table = PrefixTable()

    def _hashes(self, pending: PendingRequest | None) -> list[int]:
        if pending is None or not pending.args or not isinstance(pending.args[0], EngineRequest):
            return []
        return block_hashes(pending.args[0].prompt_ids, self.block_size)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ids = [r.replica_id for r in candidate_replicas]
        load = [self.replica_queue_len_cache.get(i) for i in ids]
        ranks = choose(self.table, ids, load, self._hashes(pending_request), self.imbalance)
        return [[candidate_replicas[i] for i in rank] for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        self.table.record(replica_id, self._hashes(pending_request))

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)


# ---- the ingress --------------------------------------------------------------------------------


def _cause(exc: BaseException) -> BaseException:
    """The error as the application should see it: a replica's own exception unwrapped, a dead
    or unreachable replica as `EngineStopped` (503)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, Exception):
        return exc.cause
    if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return EngineStopped(f"the replica serving this request stopped ({type(exc).__name__})")
    return exc


class RemoteStream(DeltaStream):
    """A replica's deltas for one request; `aclose()` aborts the request on that replica."""

    def __init__(
        self, response: DeploymentResponseGenerator, board: DeploymentHandle, replica: str, request_id: str
    ) -> None:
        self.response = response
        self.board = board
        self.replica = replica
        self.request_id = request_id

    async def _next(self) -> RequestDelta:
        try:
            return await self.response.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            raise _cause(exc) from None

    def _cancel(self) -> None:
        self.board.abort.remote(self.replica, self.request_id)
        self.response.cancel()


class ReplicaClient:
    """The `EngineClient` of the ingress: engine requests to replicas, counters from the board."""

    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle) -> None:
        self.replicas = replicas.options(stream=True)
        self.board = board

    async def generate(self, req: EngineRequest) -> RemoteStream:
        response = self.replicas.generate.remote(req)
        try:
            replica = await response.__anext__()
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as exc:
            raise _cause(exc) from None
        return RemoteStream(response, self.board, replica, req.request_id)

    @property
    def alive(self) -> bool:
        return True  # Ray Serve health-checks and replaces the replicas

    async def replica_stats(self) -> Mapping[str, EngineStats]:
        return await self.board.snapshot.remote()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress()
class Ingress:
    def __init__(self, settings: ServeSettings, replicas: DeploymentHandle, board: DeploymentHandle) -> None:
        self.settings = settings
        self.client = ReplicaClient(replicas, board)
        self.frontend = Frontend.load(settings.model)

    def __serve_build_asgi_app__(self) -> Any:
        s = self.settings
        return create_app(self.frontend, self.client, s.engine.speculative, s.model_name, s.api_key)


# ---- deploying ----------------------------------------------------------------------------------


def build_app(settings: ServeSettings) -> Any:
    """The bound application (`serve.run` takes it)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    runtime_env = {"env_vars": env}
    board = MetricsBoard.options(ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env}).bind()
    scaling: dict[str, Any] = (
        {"autoscaling_config": settings.autoscaling}
        if settings.autoscaling is not None
        else {"num_replicas": settings.replicas}
    )
    resources = {"num_cpus": settings.threads, "num_gpus": settings.gpus}
    replicas = EngineReplica.options(
        ray_actor_options={**resources, "runtime_env": runtime_env},
        max_ongoing_requests=settings.engine.max_num_seqs,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixRouter,
            request_router_kwargs={"block_size": settings.engine.block_size},
        ),
        **scaling,
    ).bind(settings, board)
    ingress = Ingress.options(ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env})
    return ingress.bind(settings, replicas, board)


def start(
    settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None
) -> None:
    """Deploy on Ray (the cluster at `ray_address`, else a local instance) and return once every
    replica is up; `stop` takes it down."""
    resolve_model(settings.model)  # fetch or convert once here, not in every replica at once
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/")


def stop() -> None:
    serve.delete(APP_NAME)
    serve.shutdown()


def run(settings: ServeSettings, host: str, port: int, ray_address: str | None = None) -> None:
    """`specdecode serve --replicas`: deploy, then serve until interrupted."""
    start(settings, host, port, ray_address)
    print(f"specdecode: {settings.replicas} replica(s) of {settings.model} at http://{host}:{port}/v1")
    done = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        loop.run_until_complete(done.wait())
    finally:
        loop.close()
        stop()
        ray.shutdown()
