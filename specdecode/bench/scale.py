"""Scale-out benchmark over HTTP: Ray Serve replicas behind the ingress against one plain server.

    specdecode bench-scale --model smollm2-135m --streams 1,4,16,64 --max-tokens 64

Each deployment is started in turn on this machine and driven through its OpenAI endpoint by N
concurrent streamed chat requests (Spec-Bench prompts, greedy): one plain `specdecode serve`
process with `--server-threads` (default 2) and with one thread, then Ray Serve with one replica
and with `--replicas` replicas (default 2) of one thread each. Reported per deployment and N:
output tokens/s of the whole load, mean time to first token as the client sees it, and whether
every answer's text equals the plain server's. The overhead Ray adds is the one-stream row of one
replica against the one-thread plain server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
from specdecode.engine.config import EngineConfig
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:  # httpx and Ray come with the [ray] extra: imported when the benchmark runs
    import httpx


@dataclass
class LoadRun:
    deployment: str
    streams: int
    output_tokens: int
    seconds: float
    mean_ttft_s: float
    same_text: bool

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise SpecDecodeError(f"{url} did not become healthy in {timeout:.0f} s")


@contextlib.contextmanager
def plain_server(args: argparse.Namespace, threads: int) -> Iterator[str]:
    """`specdecode serve` in a process of its own."""
    port = _free_port()
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--model", args.model, "--port", str(port)]
    command += ["--threads", str(threads), "--dtype", args.dtype, "--no-policy"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        yield url
    finally:
        server.terminate()
        server.wait(30)


@contextlib.contextmanager
def ray_service(args: argparse.Namespace, replicas: int) -> Iterator[str]:
    """The Ray Serve application with `replicas` one-thread replicas."""
    from specdecode.distributed import serve

    port = _free_port()
    engine = EngineConfig(policy=False)
    settings = serve.ServeSettings(model=args.model, engine=engine, dtype=args.dtype, replicas=replicas)
    serve.start(settings, port=port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.stop()


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[str, int, float]:
    """Stream one greedy chat answer: (text, tokens, seconds to its first token)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, text, tokens = 0.0, "", 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SpecDecodeError(f"{url}: {event['error']}")
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and not ttft:
                    ttft = time.perf_counter() - t0
                text += piece
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return text, tokens, ttft


async def _load(
    url: str, model: str, prompts: list[str], max_tokens: int
) -> tuple[list[str], int, float, float]:
    import httpx

    async with httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)
    ) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_one(client, url, model, p, max_tokens) for p in prompts))
        seconds = time.perf_counter() - t0
    return [d[0] for d in done], sum(d[1] for d in done), seconds, statistics.mean(d[2] for d in done)


def measure(
    url: str, name: str, args: argparse.Namespace, prompts: list[str], reference: dict
) -> list[LoadRun]:
    model = args.model
    asyncio.run(_load(url, model, prompts[:2], 8))  # warm-up
    runs = []
    for n in args.streams:
        batch = [prompts[i % len(prompts)] for i in range(n)]
        texts, tokens, seconds, ttft = asyncio.run(_load(url, model, batch, args.max_tokens))
        same = reference.setdefault(n, texts) == texts
        runs.append(LoadRun(name, n, tokens, seconds, ttft, same))
        rate = tokens / seconds
        print(f"  {name:<24} streams {n:>3}: {rate:7.1f} tok/s, TTFT {ttft:6.2f} s, same text {same}")
    return runs


def _name(kind: str, count: int, unit: str) -> str:
    return f"{kind}, {count} {unit}{'s' * (count > 1)}"


def main_args(args: argparse.Namespace) -> None:
    import ray

    questions = load_questions(args.questions, None, args.categories)
    prompts = [q["turns"][0] for q in questions]
    results: list[LoadRun] = []
    reference: dict[int, list[str]] = {}
    for threads in (args.server_threads, 1):
        with plain_server(args, threads) as url:
            results += measure(url, _name("serve", threads, "thread"), args, prompts, reference)
    ray.init(num_cpus=max(args.replicas, 1), include_dashboard=False, log_to_driver=False)
    try:
        for replicas in sorted({1, args.replicas}):
            with ray_service(args, replicas) as url:
                name = _name("ray", replicas, "replica") + " x 1 thread"
                results += measure(url, name, args, prompts, reference)
    finally:
        ray.shutdown()
    print_table(results, _name("serve", args.server_threads, "thread"))
    if args.json:
        rows = [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


def print_table(results: list[LoadRun], plain_name: str) -> None:
    """The runs against `plain_name`'s at the same streams; then Ray's overhead at the fewest
    streams (one replica against the plain server with the same one thread)."""
    base = {r.streams: r for r in results if r.deployment == plain_name}
    print()
    print(f"| deployment | streams | output tok/s | × {plain_name} | mean TTFT s | same text |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = r.tokens_per_s / base[r.streams].tokens_per_s if r.streams in base else float("nan")
        print(
            f"| {r.deployment} | {r.streams} | {r.tokens_per_s:.1f} | {ratio:.2f}x | {r.mean_ttft_s:.3f} | "
            f"{'yes' if r.same_text else 'no'} |"
        )
    fewest = min(r.streams for r in results)
    one = {r.deployment: r for r in results if r.streams == fewest}
    plain, ray1 = one.get(_name("serve", 1, "thread")), one.get(_name("ray", 1, "replica") + " x 1 thread")
    if plain and ray1:
        print(
            f"\nRay's overhead at {fewest} stream(s): TTFT {ray1.mean_ttft_s - plain.mean_ttft_s:+.3f} s, "
            f"{ray1.tokens_per_s / plain.tokens_per_s:.2f}x the tokens/s of a plain one-thread server"
        )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--replicas", type=int, default=2, help="Ray Serve replicas of one thread each")
    p.add_argument("--server-threads", type=int, default=2, help="threads of the plain server to compare")
    p.add_argument("--categories", nargs="+", default=["qa"], help="Spec-Bench categories")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
