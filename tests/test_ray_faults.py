"""A replica that dies while it serves (`specdecode.distributed.serve`): its request ends with a
clear error, never a hang, and the service goes on answering. SmolLM2 replicas of one thread
each, so that a long answer takes seconds and the replica can be killed in the middle of it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
import httpx  # noqa: E402
import openai  # noqa: E402

from specdecode.engine.config import EngineConfig  # noqa: E402
from tests.test_ray import free_port, metrics, reported, samples  # noqa: E402

pytestmark = pytest.mark.real

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    from specdecode.distributed import serve

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    port = free_port()
    settings = serve.ServeSettings(model=MODEL, engine=EngineConfig(policy=False), replicas=2, threads=1)
    serve.start(settings, port=port)
    yield f"http://127.0.0.1:{port}"
    serve.stop()
    ray.shutdown()


def kill_replica(name: str) -> None:
    """Kill the process of the engine replica called `name` (Ray Serve starts another)."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#EngineReplica#{name}"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no replica actor named {name}")


def test_closing_a_stream_in_the_ingress_aborts_the_request_on_its_replica(service: str) -> None:
    """What the ingress does when its client leaves (`RemoteStream.aclose`), driven through the
    replicas' handle: the request is aborted on the replica holding it, and its blocks freed."""
    import asyncio

    from ray import serve as ray_serve

    from specdecode.distributed.serve import APP_NAME, ReplicaClient
    from specdecode.engine.llm_engine import EngineRequest
    from specdecode.sampling import SamplingParams

    def handle(name: str):
        return ray_serve.get_deployment_handle(name, app_name=APP_NAME)

    async def leave_after_one_delta() -> None:
        replicas = ReplicaClient(handle("EngineReplica"), handle("MetricsBoard"))
        params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        stream = await replicas.generate(EngineRequest("leaver", [1, 2, 3, 4, 5], params, None))
        await anext(aiter(stream))
        await stream.aclose()

    asyncio.run(leave_after_one_delta())
    aborted = reported(service, "specdecode_requests_aborted_total", lambda f: sum(f.values()) == 1)
    used = reported(service, "specdecode_kv_blocks_used", lambda f: len(f) == 2 and not any(f.values()))
    assert set(aborted) == set(used)


def aborted_total(service: str) -> float:
    return sum(samples(metrics(service), "specdecode_requests_aborted_total").values())


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unary"])
def test_a_client_that_disconnects_from_the_ingress_frees_its_blocks(service: str, stream: bool) -> None:
    """A real HTTP client leaves mid-answer (closing the stream after a few events, or timing out
    on a long non-streamed answer): Ray Serve's proxy cancels the ingress's handler, and the
    request is aborted on the replica that holds it, its blocks freed, long before its 1000
    tokens would end."""
    before = aborted_total(service)
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 1000,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=httpx.Timeout(60, read=None if stream else 3)) as http:
        if stream:
            with http.stream("POST", service + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for i, _ in enumerate(response.iter_lines()):
                    if i == 3:
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(service + "/v1/completions", json=body)
    reported(service, "specdecode_requests_aborted_total", lambda f: sum(f.values()) == before + 1)
    reported(service, "specdecode_kv_blocks_used", lambda f: len(f) == 2 and not any(f.values()))


def test_a_killed_replica_fails_its_request_and_the_service_goes_on(service: str) -> None:
    api = openai.OpenAI(base_url=service + "/v1", api_key="unused", max_retries=0, timeout=120)
    outcome: dict[str, object] = {}
    started = threading.Event()

    def long_answer() -> None:
        text = ""
        try:
            for chunk in api.completions.create(
                model=MODEL,
                prompt="Write a long story about a lighthouse keeper.",
                max_tokens=1000,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                text += chunk.choices[0].text if chunk.choices else ""
                started.set()
            outcome["finished"] = text
        except openai.APIError as exc:
            outcome["error"] = exc

    reader = threading.Thread(target=long_answer)
    reader.start()
    assert started.wait(60), "no token arrived"
    running = reported(service, "specdecode_num_requests_running", lambda f: any(f.values()))
    victim = next(name for name, n in running.items() if n)
    kill_replica(victim)
    reader.join(60)
    assert not reader.is_alive(), "the stream hung after its replica died"
    assert "error" in outcome, outcome
    assert "replica" in str(outcome["error"]), outcome["error"]
    # The other replica answers new requests at once.
    for _ in range(3):
        done = api.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 4
