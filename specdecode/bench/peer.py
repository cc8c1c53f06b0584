"""specdecode against llama.cpp on the same GGUF, threads and prompts: `specdecode bench-peer`.

    pip install 'specdecode[peer]'   # llama-cpp-python, built for this machine (several minutes)
    specdecode bench-peer --model smollm2-135m --threads 2 --per-category 2 --plot peer.png

Each Spec-Bench question (first turn, the model's chat template, greedy, `--max-tokens`) is
decoded one at a time, as a single user would: by llama.cpp plainly and with its prompt lookup
(`LlamaPromptLookupDecoding`), then by specdecode plainly and with each `--spec`. Reported per
category and overall: output tokens/s, the ratio to llama.cpp's plain decoding, and how many
outputs equal llama.cpp's plain text (both engines dequantize the same blocks, but llama.cpp
multiplies in its own integer formats, so near-ties may break differently). The instruction set
our kernels ran on is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.plots import Panel, draw
from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.models.registry import REGISTRY, gguf_path
from specdecode.sampling import SamplingParams

LLAMA_CPP = "llama.cpp"


@dataclass
class Run:
    """One engine and method over the questions: per category, tokens and seconds."""

    name: str
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    texts: list[str] = field(default_factory=list)

    def add(self, category: str, tokens: int, seconds: float, text: str) -> None:
        self.tokens[category] += tokens
        self.seconds[category] += seconds
        self.texts.append(text)

    def as_dict(self, categories: list[str]) -> dict[str, object]:
        """The figures as JSON: tokens/s overall and per category, the counts and texts."""
        rates = {c: round(self.rate(c), 2) for c in categories}
        return {"name": self.name, "rate": round(self.rate(), 2), "rate_by_category": rates,
                "tokens": dict(self.tokens), "seconds": dict(self.seconds), "texts": self.texts}  # fmt: skip

    def rate(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        seconds = sum(self.seconds[c] for c in cats)
        return sum(self.tokens[c] for c in cats) / seconds if seconds else 0.0


def _llama(path: Path, threads: int, lookup: bool) -> Any:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise SpecDecodeError(
            "bench-peer needs llama-cpp-python: pip install 'specdecode[peer]' (it builds llama.cpp "
            "for this machine, several minutes)"
        ) from None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    # logits_all: without it, llama-cpp-python 0.3.36's prompt lookup fails on prompts over 512 tokens
    return Llama(
        model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
        draft_model=draft, logits_all=lookup, verbose=False,
    )  # fmt: skip


def run_llama_cpp(path: Path, prompts: list[tuple[str, list[int]]], args: argparse.Namespace) -> list[Run]:
    runs = []
    for lookup in (False, True):
        llama = _llama(path, args.threads, lookup)
        run = Run(f"{LLAMA_CPP} {'prompt lookup' if lookup else 'plain'}")
        for category, ids in prompts:
            llama.reset()
            start = time.perf_counter()
            out = llama.create_completion(ids, max_tokens=args.max_tokens, temperature=0.0, top_k=1)
            run.add(
                category,
                out["usage"]["completion_tokens"],
                time.perf_counter() - start,
                out["choices"][0]["text"],
            )
        runs.append(run)
        del llama
    return runs


def run_ours(
    llm: LLM, prompts: list[tuple[str, list[int]]], specs: list[dict[str, Any]], args: argparse.Namespace
) -> list[Run]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    runs = []
    for spec in [None, *specs]:
        run = Run(f"specdecode {spec['method'] if spec else 'plain'}")
        llm.generate(
            [prompts[0][1]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False, speculative=spec
        )
        for category, ids in prompts:
            llm.engine.clear_prefix_cache()  # each prompt cold, as llama.cpp's reset
            start = time.perf_counter()
            out = llm.generate([ids], params, use_tqdm=False, speculative=spec)[0]
            run.add(category, len(out.token_ids), time.perf_counter() - start, out.text)
        runs.append(run)
    return runs


def table(runs: list[Run], categories: list[str]) -> str:
    base = runs[0]
    head = (
        f"| {'engine, method':<34} | "
        + " | ".join(f"{c[:12]:>12}" for c in categories)
        + " | overall | × llama.cpp | same text |"
    )
    lines = [head, "|" + "---|" * (len(categories) + 4)]
    for run in runs:
        rates = " | ".join(f"{run.rate(c):12.1f}" for c in categories)
        same = sum(a.strip() == b.strip() for a, b in zip(run.texts, base.texts, strict=True))
        lines.append(
            f"| {run.name:<34} | {rates} | {run.rate():7.1f} | {run.rate() / base.rate():10.2f} "
            f"| {same}/{len(base.texts)} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], categories: list[str], file: str) -> None:
    series = [(run.name, [run.rate(c) for c in categories] + [run.rate()]) for run in runs]
    draw(file, [Panel("output tokens/s (one request at a time)", [*categories, "overall"], series)])


def main_args(args: argparse.Namespace) -> None:
    threads = args.threads or torch.get_num_threads()
    args.threads = threads
    torch.set_num_threads(threads)
    path = gguf_path(args.model) if args.model in REGISTRY else Path(args.model)
    if path.suffix != ".gguf" or not path.is_file():
        raise SpecDecodeError(f"bench-peer compares on a GGUF file: {args.model} is not one")
    # a short name finds its shipped heads
    llm = LLM(args.model, dtype=args.dtype, activations=args.activations, progress=False)
    questions = load_questions(args.questions, args.per_category, args.categories)
    prompts = [
        (q["category"], llm.chat_prompt([{"role": "user", "content": q["turns"][0]}])) for q in questions
    ]
    categories = sorted({c for c, _ in prompts})
    specs = args.spec if args.spec is not None else [{"method": "prompt_lookup"}]
    runs = run_llama_cpp(path, prompts, args) + run_ours(llm, prompts, specs, args)
    kernels = llm.model.kernels
    quant = kernels.quant.name if kernels.quant is not None else "none: dequantized"
    print(
        f"{path.name}, {threads} threads, {len(prompts)} prompts, {args.max_tokens} tokens, greedy; "
        f"specdecode kernels {kernels.name}, quantized {quant}, dtype {args.dtype}, "
        f"activations {args.activations}"
    )
    print(table(runs, categories))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict(categories) for r in runs], indent=2) + "\n")
    if args.plot:
        plot(runs, categories, args.plot)
        print(f"plot written to {args.plot}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--per-category", type=int, default=2, help="questions per category")
    p.add_argument("--categories", nargs="*", default=None, help="only these categories")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--spec", type=json.loads, action="append", default=None,
        help="a specdecode method as JSON, besides plain decoding (repeatable; default prompt lookup)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--plot", default=None, help="draw the comparison to this PNG (needs matplotlib)")
