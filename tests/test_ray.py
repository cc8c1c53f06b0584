"""Scale-out on Ray (`specdecode.distributed`), on a local Ray instance this module starts and
stops: two engine replicas of a tiny model behind the OpenAI-compatible ingress, driven by the
real `openai` client; prefix-aware routing; metrics across replicas; a replica killed while it
serves; and batch generation over a Ray Data dataset.

Skipped where Ray is not installed (it is an optional extra: `pip install specdecode[ray]`)."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
import openai  # noqa: E402

from specdecode import LLM, SamplingParams, SpecDecodeError  # noqa: E402
from specdecode.distributed import routing  # noqa: E402
from specdecode.engine.config import EngineConfig  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

KEY = "sesame"
MODEL = "tiny"
SPEC = {"method": "prompt_lookup", "num_candidates": 2}


# ---- routing, without Ray ----------------------------------------------------------------------


def test_routing_prefers_the_replica_holding_the_prefix_unless_it_is_much_busier() -> None:
    table = routing.PrefixTable(capacity=6)
    first = routing.block_hashes(list(range(40)), 8)  # 39 tokens before the root: 4 full blocks
    assert len(first) == 4
    second = routing.block_hashes([*range(40), 7, 7, 7, 7, 7, 7, 7, 7], 8)
    assert second[:4] == first and len(second) == 5  # a longer prompt extends the chain
    table.record("b", first)
    assert table.matched("b", second) == 4 and table.matched("a", second) == 0
    assert routing.choose(table, ["a", "b"], [0, 3], second, imbalance=4) == [[1], [0]]
    assert routing.choose(table, ["a", "b"], [0, 9], second, imbalance=4) == [[0, 1]]  # too busy: by load
    longer = routing.block_hashes([*range(40), *[7] * 48], 8)  # 4 of its 10 blocks held: too few
    assert routing.choose(table, ["a", "b"], [0, 0], longer, imbalance=4) in ([[0, 1]], [[1, 0]])
    unseen = routing.block_hashes([9] * 40, 8)
    assert routing.choose(table, ["a", "b", "c"], [5, None, 2], unseen, imbalance=4)[0] == [1, 2]
    table.record("b", unseen)  # 4 more: the oldest 2 (the first prompt's leading blocks) drop out
    assert table.matched("b", second) == 0
    table.forget("b")
    assert table.matched("b", unseen) == 0


def test_settings_are_checked() -> None:
    from specdecode.distributed.serve import ServeSettings

    with pytest.raises(SpecDecodeError, match="replicas"):
        ServeSettings(model=MODEL, replicas=0)
    with pytest.raises(SpecDecodeError, match="min_replicas"):
        ServeSettings(model=MODEL, replicas=2, min_replicas=3)
    scaled = ServeSettings(model=MODEL, replicas=2, min_replicas=1, max_replicas=4)
    assert scaled.autoscaling is not None and scaled.autoscaling["max_replicas"] == 4
    assert ServeSettings(model=MODEL, replicas=2).autoscaling is None


# ---- two replicas on a local Ray instance ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(root / "cache"))  # forwarded to the replicas
        yield str(write_tiny_gguf(root / "tiny.gguf", "llama", seed=0).path)


@pytest.fixture(scope="module")
def local_ray(model_path: str) -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def service(local_ray: None, model_path: str) -> Iterator[str]:
    from specdecode.distributed import serve

    port = free_port()
    engine = EngineConfig(block_size=4, policy=False, max_num_seqs=16)
    settings = serve.ServeSettings(model=model_path, engine=engine, replicas=2, api_key=KEY, model_name=MODEL)
    serve.start(settings, port=port)
    yield f"http://127.0.0.1:{port}"
    serve.stop()


@pytest.fixture(scope="module")
def reference(model_path: str) -> LLM:
    return LLM(model=model_path, device="cpu", progress=False)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def samples(text: str, name: str) -> dict[str, float]:
    """The samples of metric `name` by replica label."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].split("} ")
            out[labels.split('replica="')[1].split('"')[0]] = float(value)
    return out


def reported(url: str, name: str, ready: Any, timeout: float = 20.0) -> dict[str, float]:
    """Samples of `name` by replica once `ready(samples)` holds (replicas report every second)."""
    deadline = time.monotonic() + timeout
    while not ready(found := samples(metrics(url), name)):
        assert time.monotonic() < deadline, found
        time.sleep(0.5)
    return found


PROMPTS = [f"the {w} cat sat on the {w} mat, the {w} cat" for w in ("red", "big", "old", "shy", "odd", "sly")]


def test_two_replicas_answer_as_one_engine(service: str, reference: LLM) -> None:
    """Streamed and not, completions and chat, plain and speculative, concurrently: every greedy
    answer is what one engine gives."""
    api = client(service)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = {p: reference.generate([p], params, speculative=None)[0].text for p in PROMPTS}

    def ask(i: int) -> tuple[str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        extra: dict[str, Any] = {"ignore_eos": True, "speculative": SPEC if i % 2 else None}
        if i % 3 == 0:
            chunks = api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra
            )
            return prompt, "".join(c.choices[0].text for c in chunks if c.choices)
        done = api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
        )
        return prompt, done.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(18)))
    for prompt, text in answers:
        assert text == want[prompt], prompt
    messages = [{"role": "user", "content": "hello there"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    ids = reference.chat_prompt(messages)
    assert (
        chat.choices[0].message.content
        == reference.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0].text
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    # both replicas served (their counters reach the board within a second or two)
    finished = reported(service, "specdecode_requests_finished_total", lambda f: sum(f.values()) >= 19)
    assert len(finished) == 2 and all(v > 0 for v in finished.values()), finished


def test_errors_and_the_api_key_go_through_the_ingress(service: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=service + "/v1", api_key="wrong", max_retries=0).models.list()
    api = client(service)
    with pytest.raises(openai.BadRequestError, match="no such file"):  # refused by a replica's engine
        api.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=4,
            extra_body={"speculative": {"method": "draft_model", "draft_model": "/no/such/model"}},
        )
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt="hi", max_tokens=4)


def test_next_turns_reach_the_replica_holding_their_blocks(service: str) -> None:
    """Four conversations, two turns each: every second turn finds its first turn's blocks (with
    two replicas, blind routing would miss one in two)."""
    api = client(service)
    for topic in ("rivers", "mountains", "the sea", "old maps"):
        messages = [{"role": "user", "content": f"tell me a short story about {topic}, please"}]
        first = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "and then?"},
        ]
        second = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        assert second.usage is not None
        cached = second.usage.model_extra["cached_prompt_tokens"]  # type: ignore[index]
        assert first.usage is not None
        assert cached >= (first.usage.prompt_tokens - 1) // 4 * 4, (topic, cached)  # its full blocks


def test_metrics_name_every_replica(service: str) -> None:
    used = reported(service, "specdecode_kv_blocks_used", lambda f: len(f) == 2 and not any(f.values()))
    names, text = set(used), metrics(service)
    families = ("requests_total", "kv_blocks_total", "time_to_first_token_seconds_count")
    for family in families:
        assert set(samples(text, f"specdecode_{family}")) == names, family
    assert 'method="prompt_lookup",position="1"' in text  # speculation figures per method and position


# ---- batch generation over a dataset -----------------------------------------------------------


def test_generate_dataset_on_two_workers_equals_llm_generate(
    local_ray: None, model_path: str, reference: LLM
) -> None:
    from specdecode.distributed.data import generate_dataset

    prompts = [f"{PROMPTS[i % 6]} {i}" for i in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ds = ray.data.from_items([{"prompt": p, "id": i} for i, p in enumerate(prompts)])
    out = generate_dataset(ds, model_path, params, SPEC, num_workers=2, batch_size=4, device="cpu").take_all()
    want = [o.text for o in reference.generate(prompts, params, speculative=SPEC)]
    assert sorted((r["id"], r["generated_text"]) for r in out) == list(enumerate(want))
    assert all(r["num_generated_tokens"] == 8 for r in out)
    with pytest.raises(ValueError, match="no 'text' column"):
        generate_dataset(ds, model_path, params, prompt_column="text")
