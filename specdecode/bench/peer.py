"""specdecode against llama.cpp on the same GGUF, threads and prompts: `specdecode bench-peer`.

    pip install 'specdecode[peer]'   # llama-cpp-python, built for this machine (several minutes)
    specdecode bench-peer --model smollm2-135m --threads 2 --per-category 2 --plot peer.png

Each Spec-Bench question (first turn, the model's chat template, greedy, `--max-tokens`) is
decoded one at a time, as a single user would, by every engine in turn before the next question:
llama.cpp plainly and with its prompt lookup (`LlamaPromptLookupDecoding`), specdecode plainly and
with each `--spec`. Taking turns question by question, a machine whose speed drifts slows every
engine alike instead of whichever ran during the slow minutes (one engine after the other, one
run had llama.cpp at 40 tok/s and the next at 52 on the same Zen 4). Reported per category and
overall: output tokens/s, the ratio to llama.cpp's plain decoding, and how many outputs equal
llama.cpp's plain text (both engines dequantize the same blocks, but llama.cpp multiplies in its
own integer formats, so near-ties may break differently). `--repeats N` runs the questions N
times and reports medians (each ratio taken within its run first). The instruction set our
kernels ran on is printed with the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.plots import Panel, draw
from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
from specdecode.errors import SpecDecodeError, require_positive
from specdecode.llm import LLM
from specdecode.models.registry import REGISTRY, gguf_path
from specdecode.sampling import SamplingParams

LLAMA_CPP = "llama.cpp"

# One engine and method: a prompt's token ids -> (output tokens, seconds, output text).
Engine = Callable[[list[int]], tuple[int, float, str]]


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

    def rate(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        seconds = sum(self.seconds[c] for c in cats)
        return sum(self.tokens[c] for c in cats) / seconds if seconds else 0.0


NEEDS_PEER = (
    "bench-peer needs llama-cpp-python: pip install 'specdecode[peer]' (it builds llama.cpp for this "
    "machine, several minutes)"
)
# How to build llama.cpp for the instruction sets alone, not for what the compiler sees on this CPU.
PORTABLE_BUILD = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON [-DGGML_AVX512=ON '
    '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON]" pip install --force-reinstall --no-deps --no-cache-dir '
    "llama-cpp-python"
)
# Load a GGUF, take in a prompt and decode one token after it, as the benchmark will. A prompt of
# one token is not enough: a native build on a Xeon whose AMX the VM refuses (session 51) ran one
# token and died of SIGSEGV on the next prompt of two or more, which take llama.cpp's batched
# (AMX) products.
# The benchmark's llama.cpp window and prompt batch (`_llama`), which the probe takes too.
N_CTX, N_BATCH = 4096, 512
PROBE = (
    f"from llama_cpp import Llama; m = Llama(model_path={{path!r}}, n_ctx={N_CTX}, n_threads={{threads}}, "
    f"n_threads_batch={{threads}}, n_batch={N_BATCH}, verbose=False); m.eval({{ids!r}}); "
    "m.eval([m.sample(top_k=1)])"
)


def check_llama_runs(
    path: Path, ids: list[int], threads: int = 1, probe: str = PROBE, timeout: float = 900.0
) -> None:
    """Run `path` in llama.cpp once in a child process first, over the prompt `ids` and one token
    after it, with `threads`. A llama-cpp-python built for instructions this CPU does not run dies
    by a signal (SIGILL: on an Intel Xeon with AMX, session 31, its native build did on the first
    model it ran; SIGSEGV on another, session 51, once a prompt had two tokens), which would take
    the benchmark with it, unexplained."""
    code = probe.format(path=str(path), ids=ids, threads=threads)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SpecDecodeError(
            f"llama.cpp took over {timeout:g} s to run {path.name} (in a test process)"
        ) from None
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise SpecDecodeError(
            f"llama.cpp died of {name} running {path.name} (in a test process): its build uses "
            f"instructions this CPU does not run. Rebuild it for the instruction sets alone (the bracketed "
            f"flags only where the CPU has AVX-512): {PORTABLE_BUILD}"
        )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise SpecDecodeError(f"llama.cpp could not load {path.name}: {last}")


def _llama(path: Path, threads: int, lookup: bool) -> Any:
    """A loaded llama.cpp instance (after `check_llama_runs`, which already imported it)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    # logits_all: without it, llama-cpp-python 0.3.36's prompt lookup fails on prompts over 512 tokens
    return Llama(
        model_path=str(path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, n_batch=N_BATCH,
        draft_model=draft, logits_all=lookup, verbose=False,
    )  # fmt: skip


def llama_cpp_engines(path: Path, args: argparse.Namespace, warm: list[int]) -> list[tuple[str, Engine]]:
    """llama.cpp plain and with its prompt lookup, each a loaded instance, warmed up on `warm`."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise SpecDecodeError(NEEDS_PEER)
    check_llama_runs(path, warm, args.threads)
    engines: list[tuple[str, Engine]] = []
    for lookup in (False, True):
        llama = _llama(path, args.threads, lookup)

        def decode(ids: list[int], llama: Any = llama) -> tuple[int, float, str]:
            llama.reset()
            start = time.perf_counter()
            out = llama.create_completion(ids, max_tokens=args.max_tokens, temperature=0.0, top_k=1)
            return out["usage"]["completion_tokens"], time.perf_counter() - start, out["choices"][0]["text"]

        decode(warm)  # first-call costs
        engines.append((f"{LLAMA_CPP} {'prompt lookup' if lookup else 'plain'}", decode))
    return engines


def our_engines(
    llm: LLM, specs: list[dict[str, Any]], args: argparse.Namespace, warm: list[int]
) -> list[tuple[str, Engine]]:
    """specdecode plain and with each method, every prompt cold (as llama.cpp's `reset`),
    warmed up on `warm`."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engines: list[tuple[str, Engine]] = []
    for spec in [None, *specs]:

        def decode(ids: list[int], spec: dict[str, Any] | None = spec) -> tuple[int, float, str]:
            llm.engine.clear_prefix_cache()
            start = time.perf_counter()
            out = llm.generate([ids], params, use_tqdm=False, speculative=spec)[0]
            return len(out.token_ids), time.perf_counter() - start, out.text

        decode(warm)  # first-call costs (a drafter's load, allocation)
        engines.append((f"specdecode {spec['method'] if spec else 'plain'}", decode))
    return engines


def run_interleaved(
    engines: list[tuple[str, Engine]], prompts: list[tuple[str, list[int]]], repeats: int = 1
) -> list[list[Run]]:
    """Each prompt through every engine in turn, then the next prompt; `repeats` times over all
    of them: one list of runs (one per engine) per repeat."""
    rounds = []
    for _ in range(repeats):
        runs = [Run(name) for name, _ in engines]
        for category, ids in prompts:
            for run, (_, decode) in zip(runs, engines, strict=True):
                run.add(category, *decode(ids))
        rounds.append(runs)
    return rounds


@dataclass
class Summary:
    """One engine over repeated rounds: median tokens/s (overall, per category) and the median of
    its within-round ratios to the first engine (llama.cpp plain)."""

    name: str
    rate: float
    rate_by_category: dict[str, float]
    ratio: float
    ratio_runs: list[float]
    same_text: int
    outputs: int

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "rate": round(self.rate, 2),
                "rate_by_category": {c: round(r, 2) for c, r in self.rate_by_category.items()},
                "ratio": round(self.ratio, 3), "ratio_runs": [round(r, 3) for r in self.ratio_runs],
                "same_text": self.same_text, "outputs": self.outputs}  # fmt: skip


def summarize(rounds: list[list[Run]], categories: list[str]) -> list[Summary]:
    """Per engine: medians over the rounds; same text counted in the first round (greedy)."""
    out = []
    for i, run in enumerate(rounds[0]):
        mine = [r[i] for r in rounds]
        ratios = [r[i].rate() / r[0].rate() if r[0].rate() else 0.0 for r in rounds]
        same = sum(a.strip() == b.strip() for a, b in zip(run.texts, rounds[0][0].texts, strict=True))
        out.append(
            Summary(
                run.name,
                statistics.median(m.rate() for m in mine),
                {c: statistics.median(m.rate(c) for m in mine) for c in categories},
                statistics.median(ratios),
                ratios,
                same,
                len(run.texts),
            )
        )
    return out


def table(summaries: list[Summary], categories: list[str]) -> str:
    head = (
        f"| {'engine, method':<34} | "
        + " | ".join(f"{c[:12]:>12}" for c in categories)
        + " | overall | × llama.cpp | same text |"
    )
    lines = [head, "|" + "---|" * (len(categories) + 4)]
    for s in summaries:
        rates = " | ".join(f"{s.rate_by_category[c]:12.1f}" for c in categories)
        lines.append(
            f"| {s.name:<34} | {rates} | {s.rate:7.1f} | {s.ratio:10.2f} | {s.same_text}/{s.outputs} |"
        )
    if len(summaries[0].ratio_runs) > 1:
        lines.append(f"medians of {len(summaries[0].ratio_runs)} runs; × llama.cpp run by run:")
        lines += [f"  {s.name}: " + " ".join(f"{r:.2f}" for r in s.ratio_runs) for s in summaries[1:]]
    return "\n".join(lines)


def plot(summaries: list[Summary], categories: list[str], file: str) -> None:
    series = [(s.name, [s.rate_by_category[c] for c in categories] + [s.rate]) for s in summaries]
    draw(file, [Panel("output tokens/s (one request at a time)", [*categories, "overall"], series)])


def main_args(args: argparse.Namespace) -> None:
    require_positive(args, "repeats")
    threads = args.threads or torch.get_num_threads()
    args.threads = threads
    torch.set_num_threads(threads)
    path = gguf_path(args.model) if args.model in REGISTRY else Path(args.model)
    if path.suffix != ".gguf" or not path.is_file():
        raise SpecDecodeError(f"bench-peer compares on a GGUF file: {args.model} is not one")
    # a short name finds its shipped heads
    llm = LLM(
        args.model,
        dtype=args.dtype,
        activations=args.activations,
        progress=False,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    questions = load_questions(args.questions, args.per_category, args.categories)
    prompts = [
        (q["category"], llm.chat_prompt([{"role": "user", "content": q["turns"][0]}])) for q in questions
    ]
    categories = sorted({c for c, _ in prompts})
    specs = args.spec if args.spec is not None else [{"method": "prompt_lookup"}]
    warm = prompts[0][1]
    engines = llama_cpp_engines(path, args, warm) + our_engines(llm, specs, args, warm)
    summaries = summarize(run_interleaved(engines, prompts, args.repeats), categories)
    kernels = llm.model.kernels
    quant = kernels.quant.name if kernels.quant is not None else "none: dequantized"
    print(
        f"{path.name}, {threads} threads, {len(prompts)} prompts, {args.max_tokens} tokens, greedy; "
        f"specdecode kernels {kernels.name}, quantized {quant}, dtype {args.dtype}, "
        f"activations {args.activations}"
    )
    print(table(summaries, categories))
    if args.json:
        Path(args.json).write_text(json.dumps([s.as_dict() for s in summaries], indent=2) + "\n")
    if args.plot:
        plot(summaries, categories, args.plot)
        print(f"plot written to {args.plot}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench question.jsonl")
    p.add_argument("--per-category", type=int, default=2, help="questions per category")
    p.add_argument("--categories", nargs="*", default=None, help="only these categories")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="run the questions N times and report medians")
    p.add_argument(
        "--spec", type=json.loads, action="append", default=None,
        help="a specdecode method as JSON, besides plain decoding (repeatable; default prompt lookup)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--plot", default=None, help="draw the comparison to this PNG (needs matplotlib)")
