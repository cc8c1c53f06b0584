"""Batch generation on Ray Data against one process: `distributed.data.generate_dataset` over N
Spec-Bench prompts across W workers, and one `LLM.generate` call over the same prompts.

    specdecode bench-data --model smollm2-135m --num-prompts 256 --workers 2 --max-tokens 128

Prompts are the first turns in file order with the chat template, greedy, `ignore_eos` (every
prompt yields `--max-tokens` tokens). The one process gets `--threads` (default all the workers'
threads, W x `--threads-per-worker`); on Ray each worker gets `--threads-per-worker` of them, and its time
includes starting the workers and loading a model in each, as a user of the helper waits for it.
Reported: output tokens/s both ways, their ratio and how many texts are the same.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams


@dataclass
class DataRun:
    way: str
    prompts: int
    output_tokens: int
    seconds: float
    same_text: int  # prompts whose text equals the one process's

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def main_args(args: argparse.Namespace) -> None:
    import ray

    from specdecode.distributed.data import generate_dataset

    threads = args.threads or args.workers * args.threads_per_worker
    torch.set_num_threads(threads)
    questions = load_questions(args.questions, None, None)[: args.num_prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative=args.spec, num_threads=threads)
    prompts = [llm.chat_prompt([{"role": "user", "content": q["turns"][0]}]) for q in questions]

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    alone = DataRun(
        f"one LLM.generate, {threads} threads",
        len(prompts),
        sum(len(o.token_ids) for o in outs),
        time.perf_counter() - t0,
        len(prompts),
    )
    texts = [o.text for o in outs]
    del llm, outs

    ray.init(num_cpus=args.workers * args.threads_per_worker, include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        ds = ray.data.from_items([{"prompt": p, "id": i} for i, p in enumerate(prompts)])
        rows = generate_dataset(
            ds,
            args.model,
            params,
            args.spec,
            num_workers=args.workers,
            threads_per_worker=args.threads_per_worker,
            batch_size=args.batch_size,
            dtype=args.dtype,
            device=args.device,
        ).take_all()
        rows.sort(key=lambda r: int(r["id"]))  # rows come as the workers finish their batches
        seconds = time.perf_counter() - t0
    finally:
        ray.shutdown()
    on_ray = DataRun(
        f"Ray Data, {args.workers} workers x {args.threads_per_worker} thread(s)",
        len(rows),
        sum(int(r["num_generated_tokens"]) for r in rows),
        seconds,
        sum(r["generated_text"] == t for r, t in zip(rows, texts, strict=True)),
    )
    print_table([alone, on_ray])
    if args.json:
        record = [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in (alone, on_ray)]
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


def print_table(runs: list[DataRun]) -> None:
    base = runs[0].tokens_per_s
    print()
    print("| way | prompts | output tokens | seconds | tok/s | ratio | same text |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.way} | {r.prompts} | {r.output_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} | "
            f"{r.tokens_per_s / base:.2f}x | {r.same_text}/{runs[0].prompts} |"
        )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=256, help="Spec-Bench prompts, in file order")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    p.add_argument("--workers", type=int, default=2, help="Ray Data workers")
    p.add_argument("--threads-per-worker", type=int, default=1, help="CPU threads of each worker")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per LLM.generate call on a worker")
    p.add_argument("--spec", type=json.loads, default=None, help="speculative method as JSON (default plain)")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
