"""The OpenAI-compatible server, driven over loopback HTTP by the real `openai` client.

Two engines stand behind it. `ScriptedEngine` (no model: each request repeats its prompt's tokens,
two a step) makes the HTTP cases exact and quick: errors, stop strings, `n`, usage, disconnects,
an engine that fails. The real `LLMEngine` on a tiny model shows end to end that greedy
output over HTTP, streamed or not, plain or speculative, equals `LLM.generate`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest, EngineStats, LLMEngine, RequestDelta
from specdecode.outputs import SpecStats
from specdecode.serving.async_engine import AsyncEngine
from specdecode.serving.server import create_app
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
REFUSED = ord("~")  # a prompt holding this byte is refused by ScriptedEngine.add_request
BREAKS = ord("#")  # a request whose prompt holds this byte makes ScriptedEngine.step raise


# ---- the scripted engine -----------------------------------------------------------------------


class ScriptedEngine:
    """Stands in for `LLMEngine` without a model: request r emits its prompt's tokens over
    and over, `per_step` a step, until `max_tokens`; `step_s` seconds of pretend compute a step.
    One KV block per running request, so a leak shows in `stats.kv_blocks_used`."""

    def __init__(self, per_step: int = 2, step_s: float = 0.0) -> None:
        self.per_step, self.step_s = per_step, step_s
        self.stats = EngineStats(kv_blocks_total=64)
        self.running: dict[str, tuple[EngineRequest, list[int], SpecStats]] = {}
        self.seen: list[EngineRequest] = []

    def add_request(self, req: EngineRequest) -> None:
        if REFUSED in req.prompt_ids:
            raise SpecDecodeError("prompt: the scripted engine refuses '~'")
        self.seen.append(req)
        self.running[req.request_id] = (req, [], SpecStats())
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(req.prompt_ids)
        self._gauges()

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.stats.num_aborted += 1
        self._gauges()

    def step(self) -> list[RequestDelta]:
        time.sleep(self.step_s)
        if any(BREAKS in req.prompt_ids for req, _, _ in self.running.values()):
            raise RuntimeError("scripted failure")
        deltas = []
        for rid, (req, out, stats) in list(self.running.items()):
            room = req.params.max_tokens - len(out)
            new = [
                req.prompt_ids[(len(out) + k) % len(req.prompt_ids)] for k in range(min(self.per_step, room))
            ]
            out += new
            stats.record_step(1, 1, len(new) - 1, len(new))
            done = len(out) == req.params.max_tokens
            deltas.append(
                RequestDelta(rid, new, done, "length" if done else None, len(req.prompt_ids), 0, stats)
            )
            self.stats.num_generated_tokens += len(new)
            if done:
                del self.running[rid]
                self.stats.num_finished += 1
        self._gauges()
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def _gauges(self) -> None:
        self.stats.num_running = self.stats.kv_blocks_used = len(self.running)


def script(prompt_ids: list[int], n: int) -> list[int]:
    """What ScriptedEngine emits for a prompt: its tokens over and over, `n` of them."""
    return [prompt_ids[k % len(prompt_ids)] for k in range(n)]


# ---- serving on loopback -----------------------------------------------------------------------


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` under uvicorn on a free loopback port in a background thread; yield its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    root = tmp_path_factory.mktemp("server")
    path = write_tiny_gguf(root / "tiny.gguf", "llama", seed=0).path
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(root / "cache"))
        yield LLM(model=str(path), device="cpu", progress=False)


@pytest.fixture(scope="module")
def scripted(llm: LLM) -> Iterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
    async_engine.start()
    with serving(create_app(llm, async_engine, model_name=MODEL)) as url:
        yield url, engine
    async_engine.shutdown()


@pytest.fixture
def client(scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


# ---- the scripted engine behind HTTP -----------------------------------------------------------


def test_completion_text_usage_and_finish(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.tokenizer.encode("the cat", add_special_tokens=True)
    out = client.completions.create(model=MODEL, prompt="the cat", max_tokens=7)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == llm.tokenizer.decode(script(ids, 7))
    assert out.choices[0].finish_reason == "length"
    usage = out.usage.model_dump()
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 7
    assert usage["total_tokens"] == len(ids) + 7
    # two tokens a step, the second counted as an accepted draft: steps 2+2+2+1
    assert usage["num_draft_tokens"] == 4 and usage["num_accepted_tokens"] == 3
    assert usage["mean_accepted_length"] == pytest.approx(7 / 4)
    assert usage["cached_prompt_tokens"] == 0 and out.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="in 12 the tea", max_tokens=9)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="in 12 the tea",
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 2  # text arrived piece by piece
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_chat_whole_and_streamed(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the tea"}]
    ids = llm.chat_prompt(messages)
    expected = llm.tokenizer.decode(script(ids, 6))
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_text_and_aborts(scripted, client: openai.OpenAI) -> None:
    engine = scripted[1]
    aborted = engine.stats.num_aborted
    out = client.completions.create(model=MODEL, prompt="tea-in", max_tokens=60, stop=["-"])
    assert out.choices[0].text == "tea" and out.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model=MODEL, prompt="tea-in", max_tokens=60, stop="in", stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == "tea-"
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_for(lambda: engine.stats.num_aborted == aborted + 2 and not engine.running)


def test_n_choices_get_distinct_derived_seeds(scripted, client: openai.OpenAI) -> None:
    engine = scripted[1]
    before = len(engine.seen)
    out = client.completions.create(model=MODEL, prompt="a b", max_tokens=3, n=2, seed=7, temperature=0.5)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # the script ignores the seed
    reqs = engine.seen[before:]
    assert sorted(r.params.seed for r in reqs) == [7, 8]
    assert all(r.params.temperature == 0.5 for r in reqs)
    assert out.usage.prompt_tokens == reqs[0].prompt_ids.__len__()  # the prompt counts once
    assert out.usage.completion_tokens == 6
    # several prompts, n each: indices prompt-major
    many = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=2, n=2)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == ["ab", "ab", "cd", "cd"]


def test_speculative_field_reaches_the_engine(scripted, client: openai.OpenAI) -> None:
    engine = scripted[1]
    before = len(engine.seen)
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"speculative": None})
    client.completions.create(
        model=MODEL, prompt="x", max_tokens=1, extra_body={"speculative": {"method": "prompt_lookup"}}
    )
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    client.chat.completions.create(  # the "off" values of unsupported parameters are accepted
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        logprobs=False,
        frequency_penalty=0.0,
        response_format={"type": "text"},
    )
    plain, lookup, default, _ = (r.speculative for r in engine.seen[before:])
    assert plain is None and default is None  # this server's default is plain decoding
    assert lookup is not None and lookup.method == "prompt_lookup"


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


BAD_COMPLETIONS = [
    # (body or raw text, status, param)
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ('{"model": "tiny", "prompt": ', 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL, "prompt": 12}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 9999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "the " * 200}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": "x", "speculative": {"method": "magic"}}, 400, "speculative"),
    (
        {"model": MODEL, "prompt": "x", "speculative": {"method": "prompt_lookup", "window_size": 2}},
        400,
        "speculative",
    ),
    ({"model": MODEL, "prompt": "x", "speculative": "prompt_lookup"}, 400, "speculative"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_input(scripted, body, status: int, param: str | None) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        scripted[0] + "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param, err
    if param is not None:
        assert param in err["message"]


BAD_CHATS = [
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "the " * 200}]}, 400, "messages"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 999},
        400,
        "max_tokens",
    ),
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        400,
        "top_logprobs",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHATS)
def test_bad_chat_input(scripted, body, status: int, param: str) -> None:
    r = httpx.post(scripted[0] + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param


def test_engine_refusal_is_a_400_and_frees_the_other_choices(scripted) -> None:
    engine = scripted[1]
    r = httpx.post(
        scripted[0] + "/v1/completions", json={"model": MODEL, "prompt": ["ab", "a~"], "max_tokens": 50}
    )
    assert r.status_code == 400 and "refuses" in error_of(r)["message"]
    wait_for(lambda: not engine.running)  # "ab" was accepted first, then aborted


def test_openai_client_raises_on_bad_input(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def value(text: str, name: str) -> float:
    """The value of the metric line `name` (with its labels) in a /metrics text."""
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_models_health_metrics_and_unknown_path(scripted, client: openai.OpenAI) -> None:
    url = scripted[0]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    before = httpx.get(url + "/metrics").text
    client.completions.create(model=MODEL, prompt="ab", max_tokens=4)
    after = httpx.get(url + "/metrics").text

    assert value(after, "specdecode_requests_total") == value(before, "specdecode_requests_total") + 1
    assert (
        value(after, "specdecode_generation_tokens_total")
        == value(before, "specdecode_generation_tokens_total") + 4
    )
    assert "# TYPE specdecode_kv_blocks_used gauge" in after
    assert value(after, "specdecode_kv_blocks_used") == 0
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"


def test_api_key(llm: LLM) -> None:
    async_engine = AsyncEngine(ScriptedEngine())  # type: ignore[arg-type]
    async_engine.start()
    try:
        with serving(create_app(llm, async_engine, model_name=MODEL, api_key="sesame")) as url:
            body = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}):
                r = httpx.post(url + "/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
            assert httpx.get(url + "/v1/models").status_code == 401
            assert httpx.get(url + "/health").status_code == 200  # probes need no key
            good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
            assert good.completions.create(**body).choices[0].text == "ab"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).completions.create(**body)
    finally:
        async_engine.shutdown()


def test_failing_step_fails_its_requests_but_not_the_server(scripted, client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="a#", max_tokens=4)
    assert client.completions.create(model=MODEL, prompt="ab", max_tokens=4).choices[0].text == "abab"
    assert httpx.get(scripted[0] + "/health").status_code == 200


def test_disconnects_abort_their_requests(llm: LLM) -> None:
    engine = ScriptedEngine(per_step=1, step_s=0.01)
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
    async_engine.start()
    try:
        with serving(create_app(llm, async_engine, model_name=MODEL)) as url:
            body = {"model": MODEL, "prompt": "ab", "max_tokens": 100, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # streaming has begun; now hang up
            wait_for(lambda: engine.stats.num_aborted == 1)
            with pytest.raises(httpx.ReadTimeout):  # a whole (non-streamed) answer, abandoned
                httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.2)
            wait_for(lambda: engine.stats.num_aborted == 2)
            assert engine.stats.kv_blocks_used == 0 and not engine.running
            assert engine.stats.num_finished == 0
    finally:
        async_engine.shutdown()


def test_serve_freezes_what_was_loaded(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` moves what is alive when it starts (the model, tokenizer and engine, which live as
    long as the server) out of the cyclic collector's scans before it takes requests."""
    import gc

    from specdecode.serving import server

    frozen: list[int] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: frozen.append(gc.get_freeze_count()))
    try:
        server.serve(llm, EngineConfig())
    finally:
        gc.unfreeze()
    assert len(frozen) == 1 and frozen[0] > 10_000


def test_serve_command_refuses_bad_settings_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    from specdecode.cli import main

    assert main(["serve", "--model", "no-such-model", "--speculative", '{"method": "magic"}']) == 2
    assert "magic" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-memory", "lots"])
    assert "--kv-cache-memory" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "size"), [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1000", 1000)])
def test_memory_sizes(text: str, size: int) -> None:
    from specdecode.cli import _memory_size

    assert _memory_size(text) == size


# ---- the real serving engine behind HTTP -------------------------------------------------------

GREEDY_PROMPTS = ["the the tea in the tea", "in 12 12 12 in", "the a the a the a"]
SPECS = [
    None,
    {"method": "prompt_lookup"},
    {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3},
]


@pytest.fixture(scope="module")
def real(llm: LLM) -> Iterator[tuple[str, LLMEngine]]:
    """The real engine on the tiny model; the policy off, so every request drafts as it asks."""
    engine = llm.new_engine(EngineConfig(block_size=4, max_num_seqs=8, max_batch_tokens=64, policy=False))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    with serving(create_app(llm, async_engine, model_name=MODEL)) as url:
        yield url, engine
    async_engine.shutdown()


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "prompt_lookup", "lookahead"])
def test_greedy_over_http_equals_llm_generate(real, llm: LLM, spec) -> None:
    client = openai.OpenAI(base_url=real[0] + "/v1", api_key="x", max_retries=0)
    params = SamplingParams(max_tokens=20, temperature=0)
    extra = {"speculative": spec}
    drafted = 0
    for prompt in GREEDY_PROMPTS:
        expected = llm.generate(prompt, params, speculative=None)[0]
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body=extra
        )
        assert out.choices[0].text == expected.text, (prompt, spec)
        assert out.usage.completion_tokens == len(expected.token_ids)
        drafted += out.usage.model_dump()["num_draft_tokens"]
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert (drafted > 0) == (spec is not None)
    messages = [{"role": "user", "content": GREEDY_PROMPTS[0]}]
    expected = llm.chat(messages, params, speculative=None)[0]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, extra_body=extra
    )
    assert out.choices[0].message.content == expected.text
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_real_concurrent_n_and_metrics(real, llm: LLM) -> None:
    url, engine = real
    metrics_before = httpx.get(url + "/metrics").text
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    jobs = [(p, s) for p in GREEDY_PROMPTS for s in SPECS]

    def send(job) -> list[str]:
        prompt, spec = job
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            n=2,
            extra_body={"speculative": spec, "ignore_eos": True},
        )
        return [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        for (prompt, _), texts in zip(jobs, pool.map(send, jobs), strict=True):
            expected = llm.generate(prompt, params, speculative=None)[0].text
            assert texts == [expected, expected]
    wait_for(lambda: engine.stats.kv_blocks_used == 0)
    after = httpx.get(url + "/metrics").text
    assert 'specdecode_draft_tokens_proposed_total{method="prompt_lookup"}' in after
    assert after != metrics_before
    # Every request's first token and decode speed were timed by the engine.
    count = value(after, "specdecode_time_to_first_token_seconds_count")
    assert count - value(metrics_before, "specdecode_time_to_first_token_seconds_count") == 2 * len(jobs)
    assert value(after, 'specdecode_time_to_first_token_seconds_bucket{le="+Inf"}') == count
    assert value(after, "specdecode_time_per_output_token_seconds_sum") > 0
    out = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL, prompt="the tea in", max_tokens=8, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    usage = out.usage.model_dump()
    assert usage["time_to_first_token_s"] > 0 and len(usage["decode_tokens_per_s"]) == 2


@pytest.mark.parametrize("spec", SPECS[:2], ids=["plain", "prompt_lookup"])
def test_seeded_choices_sample_as_llm_generate_with_seed_plus_k(real, llm: LLM, spec) -> None:
    client = openai.OpenAI(base_url=real[0] + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model=MODEL,
        prompt="the tea in",
        max_tokens=12,
        temperature=0.8,
        seed=5,
        n=2,
        extra_body={"speculative": spec, "ignore_eos": True},
    )
    expected = [
        llm.generate("the tea in", SamplingParams(12, 0.8, seed=seed, ignore_eos=True), speculative=spec)[
            0
        ].text
        for seed in (5, 6)
    ]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert expected[0] != expected[1]


def test_burst_of_malformed_requests_among_valid_ones(real, llm: LLM) -> None:
    """Bad requests (the HTTP layer's and one the engine refuses) interleaved with valid ones."""
    url = real[0]
    refused = {"model": MODEL, "prompt": "x", "speculative": {"method": "draft_model", "draft_model": "nope"}}
    bad = [refused] + [body for body, _, _ in BAD_COMPLETIONS]
    good = [f"the {k} tea in {k % 3}" for k in range(12)]
    jobs = [job for pair in zip(bad, good * 3, strict=False) for job in pair]

    def send(job) -> tuple[int, str]:
        if job in good:
            body = {"model": MODEL, "prompt": job, "max_tokens": 8, "temperature": 0}
            body["speculative"] = SPECS[len(job) % len(SPECS)]
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            return r.status_code, r.json()["choices"][0]["text"]
        content = job if isinstance(job, str) else json.dumps(job)
        r = httpx.post(url + "/v1/completions", content=content, timeout=60)
        return r.status_code, error_of(r)["message"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, jobs))
    params = SamplingParams(max_tokens=8, temperature=0)
    for job, (status, text) in zip(jobs, answers, strict=True):
        if job in good:
            assert (status, text) == (200, llm.generate(job, params, speculative=None)[0].text)
        else:
            assert 400 <= status < 500, (job, text)
    assert answers[jobs.index(refused)][1].startswith("unknown model 'nope'")


def test_real_prefix_reuse_shows_in_usage_and_metrics(real, llm: LLM) -> None:
    url, engine = real
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    prompts = ["in the tea the 12 in a tea the", "in the tea the 12 in a tea a"]
    first, second = (llm.tokenizer.encode(p, add_special_tokens=True) for p in prompts)
    shared = next(k for k, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    full_blocks = shared // 4  # the fixture's block size
    assert full_blocks >= 2
    reused = engine.stats.kv_blocks_reused
    out = [client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0) for p in prompts]
    assert out[0].usage.prompt_tokens_details.cached_tokens == 0
    assert out[1].usage.prompt_tokens_details.cached_tokens == 4 * full_blocks
    assert out[1].usage.model_dump()["cached_prompt_tokens"] == 4 * full_blocks
    assert engine.stats.kv_blocks_reused == reused + full_blocks


def test_real_disconnect_frees_blocks(real) -> None:
    url, engine = real
    aborted = engine.stats.num_aborted
    body = {"model": MODEL, "prompt": "the tea", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        assert next(r.iter_lines()).startswith("data: ")
    wait_for(lambda: engine.stats.num_aborted == aborted + 1)
    wait_for(lambda: engine.stats.kv_blocks_used == 0 and not engine.has_unfinished())


def direct_logprobs(llm: LLM, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """(len(output_ids), V) log_softmax of the target's logits where each output token was
    generated, from one plain forward over the whole sequence (no engine, no speculation)."""
    ids = prompt_ids + output_ids
    model = llm.model
    with torch.inference_mode():
        hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(len(ids)))[0]
        rows = hidden[len(prompt_ids) - 1 : len(ids) - 1]  # row i predicts ids[i + 1]
        return torch.log_softmax(model.logits(rows), -1)


def test_completion_logprobs_are_the_targets_with_and_without_speculation(real, llm: LLM) -> None:
    client = openai.OpenAI(base_url=real[0] + "/v1", api_key="x", max_retries=0)
    prompt = GREEDY_PROMPTS[2]  # prompt lookup's drafts get accepted on it
    expected = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), speculative=None
    )[0]
    direct = direct_logprobs(llm, expected.prompt_token_ids, expected.token_ids)
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    answers = {}
    for name, spec in (("plain", None), ("lookup", SPECS[1])):
        extra = {"speculative": spec, "ignore_eos": True}
        out = client.completions.create(**kwargs, extra_body=extra)
        lp = out.choices[0].logprobs
        assert out.choices[0].text == expected.text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
        assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
        assert lp.text_offset == [len(llm.tokenizer.decode(expected.token_ids[:i])) for i in range(12)]
        chosen = direct[torch.arange(12), torch.tensor(expected.token_ids)].tolist()
        assert lp.token_logprobs == pytest.approx(chosen, abs=1e-4)
        for top, token, row in zip(lp.top_logprobs, lp.tokens, direct, strict=True):
            values = list(top.values())
            assert 1 <= len(top) <= 4 and values == sorted(values, reverse=True)
            assert (
                values[0] == pytest.approx(float(row.max()), abs=1e-4) and top[token] == values[0]
            )  # greedy
        if spec is not None:
            assert out.usage.model_dump()["num_accepted_tokens"] > 0  # accepted rows were used
        chunks = list(client.completions.create(**kwargs, stream=True, extra_body=extra))
        streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        # the same up to rounding: the stream reuses the first request's prompt blocks
        assert [x for c in streamed for x in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
        assert [x for c in streamed for x in c.text_offset] == lp.text_offset
        answers[name] = lp
    assert answers["lookup"].token_logprobs == pytest.approx(answers["plain"].token_logprobs, abs=1e-5)
    assert answers["lookup"].top_logprobs[0] == pytest.approx(answers["plain"].top_logprobs[0], abs=1e-5)


def test_chat_logprobs_whole_and_streamed(real, llm: LLM) -> None:
    client = openai.OpenAI(base_url=real[0] + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": GREEDY_PROMPTS[1]}]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = llm.chat(messages, params, speculative=None)[0]
    direct = direct_logprobs(llm, expected.prompt_token_ids, expected.token_ids)
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True}
    extra = {"speculative": SPECS[1], "ignore_eos": True}
    out = client.chat.completions.create(**kwargs, top_logprobs=5, extra_body=extra)
    content = out.choices[0].logprobs.content
    assert len(content) == 10
    for entry, token, row in zip(content, expected.token_ids, direct, strict=True):
        assert entry.token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
    chunks = list(client.chat.completions.create(**kwargs, top_logprobs=5, stream=True, extra_body=extra))
    streamed = [e for c in chunks if c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    # The same tokens and candidates; the values agree to float32 rounding, not bitwise: the
    # second request reuses the first's prompt blocks, so its rows run in other forwards.
    assert len(streamed) == len(content)
    for got, want in zip(streamed, content, strict=True):
        assert (got.token, got.bytes) == (want.token, want.bytes)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        tops = [t.logprob for t in want.top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(tops, abs=1e-4)
    bare = client.chat.completions.create(**kwargs, extra_body=extra)  # no top_logprobs: none listed
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * 10
    assert client.chat.completions.create(**kwargs | {"logprobs": False}).choices[0].logprobs is None


@pytest.mark.real
def test_smollm2_chat_over_http_equals_llm_chat() -> None:
    llm = LLM(model="smollm2-135m", progress=False)
    config = EngineConfig(kv_cache_memory=64 * 2**20, max_num_seqs=4, policy=False)
    async_engine = AsyncEngine(llm.new_engine(config))
    async_engine.start()
    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    expected = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0), speculative=None)[0]
    try:
        with serving(create_app(llm, async_engine)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            out = client.chat.completions.create(
                model="smollm2-135m",
                messages=messages,
                max_tokens=24,
                temperature=0,
                extra_body={"speculative": {"method": "prompt_lookup"}},
            )
    finally:
        async_engine.shutdown()
    assert out.choices[0].message.content == expected.text
    usage = out.usage.model_dump()
    assert usage["num_draft_tokens"] > 0 and usage["mean_accepted_length"] > 1


def test_serve_command_end_to_end(llm: LLM, tmp_path: Path) -> None:
    """`specdecode serve` in a subprocess: it answers, and stops cleanly on Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "specdecode.cli",
        "serve",
        "--model",
        llm.model_name,
        "--port",
        str(port),
    ]
    command += ["--threads", "1", "--speculative", '{"method": "prompt_lookup"}', "--api-key", "k"]
    command += ["--max-batch-tokens", "64"]  # the load policy measures forwards this wide: < the context
    env = {**os.environ, "SPECDECODE_CACHE": os.environ.get("SPECDECODE_CACHE", str(tmp_path))}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        # A new process with this module's cache compiles the CPU kernels there first (~55 s on a
        # 2-core Xeon; over 60 s once on a loaded CI host), then starts in seconds.
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not come up:\n{proc.communicate()[0]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        out = client.completions.create(
            model=llm.model_name, prompt="the tea the tea", max_tokens=8, temperature=0
        )
        expected = llm.generate("the tea the tea", SamplingParams(max_tokens=8, temperature=0))[0]
        assert out.choices[0].text == expected.text
        assert out.usage.model_dump()["num_draft_tokens"] > 0  # --speculative is the default
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
