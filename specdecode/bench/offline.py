"""Offline throughput of `LLM.generate`: N prompts in one call against the same prompts one at a time.

    specdecode bench-offline --model smollm2-135m --num-prompts 64 --max-tokens 128 --threads 2

For plain decoding and each `--spec`, in one run on one `LLM`: the N Spec-Bench prompts (first
turns, chat template, greedy, `ignore_eos` so every prompt yields `--max-tokens` tokens) are
generated one call per prompt (`--sequential` of them, default all: a batch of one each), then all
in one `generate` call (in-flight batching up to `max_num_seqs`). Reported: output tokens/s of
each, their ratio, and whether each prompt's tokens are the same both ways.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.spec_config import parse_speculative


@dataclass
class OfflineResult:
    """One method, both ways."""

    method: str
    num_prompts: int
    sequential_prompts: int
    sequential_tokens_per_s: float
    batched_tokens_per_s: float
    tau: float  # tokens per target forward over the batched call's requests
    same_tokens: int  # prompts (of those run both ways) whose greedy tokens are equal

    @property
    def speedup(self) -> float:
        return self.batched_tokens_per_s / self.sequential_tokens_per_s


def run_method(
    llm: LLM, prompts: list[list[int]], spec: dict | None, max_tokens: int, sequential: int
) -> OfflineResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    name = "plain" if spec is None else json.dumps(spec)
    alone: list[list[int]] = []
    t0 = time.perf_counter()
    for p in tqdm(prompts[:sequential], desc=f"{name} one at a time", unit="prompt"):
        alone.append(llm.generate([p], params, speculative=spec)[0].token_ids)
    seq_s = time.perf_counter() - t0
    llm.engine.clear_prefix_cache()  # the batched call must not reuse the first pass's blocks
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, speculative=spec, use_tqdm=True)
    batch_s = time.perf_counter() - t0
    forwards = sum(o.stats.num_target_forwards for o in outs)
    return OfflineResult(
        method=name,
        num_prompts=len(prompts),
        sequential_prompts=sequential,
        sequential_tokens_per_s=sum(map(len, alone)) / seq_s,
        batched_tokens_per_s=sum(len(o.token_ids) for o in outs) / batch_s,
        tau=sum(o.stats.num_generated_tokens for o in outs) / max(forwards, 1),
        same_tokens=sum(a == o.token_ids for a, o in zip(alone, outs, strict=False)),
    )


def print_table(results: list[OfflineResult]) -> None:
    print()
    print("| method | prompts | one at a time tok/s | one generate call tok/s | ratio | τ | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.method} | {r.num_prompts} | {r.sequential_tokens_per_s:.1f} | "
            f"{r.batched_tokens_per_s:.1f} | "
            f"{r.speedup:.2f}x | {r.tau:.2f} | {r.same_tokens}/{r.sequential_prompts} |"
        )


def main_args(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    spec_args = args.spec or [{"method": "prompt_lookup"}]
    for spec in spec_args:
        parse_speculative(spec)  # a bad setting fails before the model loads
    specs: list[dict | None] = [None, *spec_args]
    questions = load_questions(args.questions, None, None)[: args.num_prompts]
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs)
    prompts = [llm.chat_prompt([{"role": "user", "content": q["turns"][0]}]) for q in questions]
    sequential = len(prompts) if args.sequential is None else min(args.sequential, len(prompts))
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    results = [run_method(llm, prompts, spec, args.max_tokens, sequential) for spec in specs]
    print_table(results)
    if args.json:
        record = {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "results": [asdict(r) | {"speedup": r.speedup} for r in results],
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="Spec-Bench prompts, in file order")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    p.add_argument(
        "--spec",
        type=json.loads,
        action="append",
        default=None,
        help="a speculative method as JSON, besides plain decoding (repeatable; default prompt lookup)",
    )
    p.add_argument("--sequential", type=int, default=None, help="prompts run one at a time (default all)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoding together")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
