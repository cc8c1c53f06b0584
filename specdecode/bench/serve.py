"""Load benchmark of the serving engine (no HTTP): throughput and latency against concurrency.

    specdecode bench-serve --model smollm2-135m --streams 1,4,16,64 --max-tokens 64

For each number of concurrent streams N, N Spec-Bench prompts are submitted at once to a fresh
`LLMEngine` and run to completion, three ways in one run: speculation off, on (every request
with `--spec`, default prompt lookup) and on under the load policy. Reported: output tokens/s of
the whole batch, mean time to first token, and mean per-stream decoding tokens/s (tokens after
the first per second after the first). All greedy, so the three modes emit the same tokens
(checked). Then prefix reuse: the time to first token of a request whose long prefix (system
prompt and article) an earlier request already cached, against the same request after the prefix
cache is cleared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest
from specdecode.engine.policy import LatencyCurve
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.spec_config import SpecConfig, parse_speculative

MODES = ("off", "on", "policy")


@dataclass
class LoadResult:
    """One (mode, streams) run."""

    mode: str
    streams: int
    output_tokens: int
    seconds: float
    mean_ttft_s: float
    per_stream_tokens_per_s: float
    tau: float  # tokens per target forward, averaged over requests

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_load(
    llm: LLM,
    prompts: list[list[int]],
    spec: SpecConfig | None,
    config: EngineConfig,
    max_tokens: int,
) -> tuple[LoadResult, list[list[int]]]:
    """Submit every prompt at once to a fresh engine and run until all finish."""
    engine = llm.new_engine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), ids, params, spec, arrival_time=t0))
    tokens: list[list[int]] = [[] for _ in prompts]
    first: list[float] = [0.0] * len(prompts)
    last: list[float] = [0.0] * len(prompts)
    taus: list[float] = [0.0] * len(prompts)
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            i = int(d.request_id)
            if d.new_token_ids and not tokens[i]:
                first[i] = now
            tokens[i] += d.new_token_ids
            last[i] = now
            taus[i] = d.stats.mean_accepted_length
    seconds = time.perf_counter() - t0
    per_stream = [
        (len(t) - 1) / (b - a) for t, a, b in zip(tokens, first, last, strict=True) if len(t) > 1 and b > a
    ]
    result = LoadResult(
        mode="",
        streams=len(prompts),
        output_tokens=sum(len(t) for t in tokens),
        seconds=seconds,
        mean_ttft_s=statistics.mean(f - t0 for f in first),
        per_stream_tokens_per_s=statistics.mean(per_stream) if per_stream else 0.0,
        tau=statistics.mean(taus),
    )
    return result, tokens


@dataclass
class PrefixResult:
    prefix_tokens: int
    reused_blocks: int
    ttft_reused_s: float
    ttft_cold_s: float


def prefix_reuse(llm: LLM, article: str, config: EngineConfig) -> PrefixResult:
    """TTFT of a second question about the same article, with its prefix cached and without."""
    engine = llm.new_engine(config)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def ask(rid: str, question: str) -> tuple[float, int]:
        ids = llm.chat_prompt([{"role": "user", "content": f"{article}\n\n{question}"}])
        t0 = time.perf_counter()
        engine.add_request(EngineRequest(rid, ids, params, None))
        ttft, cached = 0.0, 0
        while engine.has_unfinished():
            for d in engine.step():
                if d.new_token_ids and not ttft:
                    ttft, cached = time.perf_counter() - t0, d.num_cached_prompt_tokens
        return ttft, cached

    ask("first", "Summarize the text above in one sentence.")
    before = engine.stats.kv_blocks_reused
    ttft_reused, cached = ask("second", "List three keywords of the text above.")
    reused = engine.stats.kv_blocks_reused - before
    engine.clear_prefix_cache()
    ttft_cold, _ = ask("third", "List three keywords of the text above.")
    return PrefixResult(cached, reused, ttft_reused, ttft_cold)


def main_args(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    spec = parse_speculative(args.spec)
    if spec is None:
        raise SpecDecodeError("--spec must name a speculative method (speculation on is one of the modes)")
    streams = sorted(set(args.streams))
    questions = load_questions(args.questions, None, args.categories)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, progress=True)
    prompts = [llm.chat_prompt([{"role": "user", "content": q["turns"][0]}]) for q in questions]
    base = dict(block_size=args.block_size, max_batch_tokens=args.max_batch_tokens, max_num_seqs=max(streams))
    if args.kv_cache_memory is not None:
        base["kv_cache_memory"] = args.kv_cache_memory
    print(f"measuring the forward-latency curve up to {args.max_batch_tokens} tokens ...", flush=True)
    curve = LatencyCurve.measure(llm.model, args.max_batch_tokens, timer=llm.engine.forward_seconds)
    points = tuple(zip(curve.tokens, curve.seconds, strict=True))
    print("  " + ", ".join(f"{t}: {s * 1e3:.0f} ms" for t, s in points), flush=True)
    configs = {
        "off": (None, EngineConfig(**base, policy=False)),
        "on": (spec, EngineConfig(**base, policy=False)),
        "policy": (spec, EngineConfig(**base, policy=True, latency_curve=points)),
    }
    run_load(llm, prompts[:2], spec, configs["policy"][1], 8)  # warm-up
    results: list[LoadResult] = []
    mismatches = 0
    for n in streams:
        batch = [prompts[i % len(prompts)] for i in range(n)]
        outputs = {}
        for mode in MODES:
            mode_spec, config = configs[mode]
            result, tokens = run_load(llm, batch, mode_spec, config, args.max_tokens)
            result.mode = mode
            outputs[mode] = tokens
            results.append(result)
            print(
                f"  streams {n:>3} {mode:<6}: {result.tokens_per_s:7.1f} tok/s, "
                f"TTFT {result.mean_ttft_s:6.2f} s, per stream {result.per_stream_tokens_per_s:6.1f} tok/s, "
                f"tau {result.tau:.2f}",
                flush=True,
            )
        mismatches += sum(outputs[m] != outputs["off"] for m in MODES)
    article = max((q["turns"][0] for q in questions), key=len)
    prefix = prefix_reuse(llm, article, EngineConfig(**base, policy=False))
    print_table(results, prefix, mismatches)
    if args.json:
        record = {
            "model": args.model,
            "spec": args.spec,
            "max_tokens": args.max_tokens,
            "categories": args.categories,
            "latency_curve": points,
            "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
            "prefix_reuse": asdict(prefix),
            "greedy_mismatches": mismatches,
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


def print_table(results: list[LoadResult], prefix: PrefixResult, mismatches: int) -> None:
    by = {(r.mode, r.streams): r for r in results}
    single = by.get(("off", min(r.streams for r in results)))
    print()
    print("| streams | mode | output tok/s | vs off | vs 1 stream off | mean TTFT s | per-stream tok/s | τ |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        off = by[("off", r.streams)]
        scale = r.tokens_per_s / single.tokens_per_s if single else float("nan")
        print(
            f"| {r.streams} | {r.mode} | {r.tokens_per_s:.1f} | {r.tokens_per_s / off.tokens_per_s:.2f}x | "
            f"{scale:.2f}x | {r.mean_ttft_s:.2f} | {r.per_stream_tokens_per_s:.1f} | {r.tau:.2f} |"
        )
    print()
    print(
        f"prefix reuse: {prefix.prefix_tokens} prompt tokens from {prefix.reused_blocks} reused blocks; "
        f"TTFT {prefix.ttft_reused_s:.3f} s reused vs {prefix.ttft_cold_s:.3f} s recomputed"
    )
    print(f"greedy outputs equal across modes: {'yes' if mismatches == 0 else f'no ({mismatches} differ)'}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--spec", type=json.loads, default={"method": "prompt_lookup"}, help="speculative JSON")
    p.add_argument(
        "--categories",
        nargs="+",
        default=["qa"],
        help="Spec-Bench categories (default qa: short chat prompts, a decode-bound load; "
        "summarization's ~700-token articles make prefill most of the work)",
    )
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for KV blocks")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
