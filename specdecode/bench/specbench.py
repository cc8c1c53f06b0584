"""Spec-Bench: plain decoding and speculative methods on the same questions, in one process.

    specdecode bench --model smollm2-135m --method prompt_lookup --method lookahead --per-category 2

For each question (both turns of MT-Bench ones) every method runs back to back, so machine noise
hits them alike. Reported per category and overall: tokens/s, speedup over plain decoding measured
in this run, τ (tokens per target forward), and whether every greedy output equals plain decoding.
With `--transformers`, Hugging Face transformers runs the same prompts (plain `generate`, and its
`prompt_lookup_num_tokens` / `assistant_model` equivalents of our methods) as the peer baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import SpecDecodeError, require_positive
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams
from specdecode.spec_config import (
    DraftModelConfig,
    Eagle2Config,
    LookaheadConfig,
    LookupBranchOptions,
    PromptLookupConfig,
    ReDrafterConfig,
    SpecConfig,
    parse_speculative,
)

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2].parent / "shared/data/spec_bench/question.jsonl"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def category_of(question: dict[str, Any]) -> str:
    """Spec-Bench's reporting category: the eight MT-Bench sub-categories count as one, unless a
    filter named the sub-category (`load_questions`: then it is reported on its own)."""
    if "report_as" in question:
        return question["report_as"]
    return "mt_bench" if question["category"] in MT_BENCH else question["category"]


def load_questions(path: str | Path, per_category: int | None, categories: list[str] | None) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise SpecDecodeError(f"question file {file} not found")
    questions: list[dict] = []
    seen: dict[str, int] = defaultdict(int)
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            cat = category_of(q)
            q["turns"] = list(q["turns"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpecDecodeError(
                f"{file}:{n}: not a Spec-Bench question (needs category and turns)"
            ) from None
        if categories and q["category"] in MT_BENCH and q["category"] in categories:
            cat = q["report_as"] = q["category"]  # e.g. "coding": MT-Bench's coding questions alone
        elif categories and cat not in categories:
            continue
        if per_category is not None and seen[cat] >= per_category:
            continue
        seen[cat] += 1
        questions.append(q)
    if not questions:
        raise SpecDecodeError(f"no questions selected from {file}")
    return questions


@dataclass
class Tally:
    """Totals of one method in one category."""

    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    outputs: int = 0
    mismatches: int = 0
    # After each output's first token (what decoding, not the prompt's prefill, costs): 0 for
    # transformers' runs, which report no first-token time.
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def add(self, other: Tally) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.forwards += other.forwards
        self.outputs += other.outputs
        self.mismatches += other.mismatches
        self.decode_tokens += other.decode_tokens
        self.decode_seconds += other.decode_seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


@dataclass
class Method:
    """One column of the benchmark: ours (a spec, None = plain) or transformers' (`peer`)."""

    label: str
    spec: SpecConfig | None
    peer: bool = False
    tallies: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    # transformers' plain greedy where it differs from ours: at the first token that differs,
    # how far its own logits put its token above ours, in units of the dtype's rounding step there
    tie_gaps: list[float] = field(default_factory=list)
    # Its decoding steps by rows in their forward: [steps, seconds, forward seconds]
    # (`EngineStats.decode_steps`)
    steps: dict[int, list[float]] = field(default_factory=dict)

    def count_steps(self, before: dict[int, list[float]], after: dict[int, list[float]]) -> None:
        """Add the engine's decoding steps between two copies of its counts."""
        for rows, (n, seconds, forward) in after.items():
            n0, s0, f0 = before.get(rows, (0, 0.0, 0.0))
            if n > n0:
                add_steps(self.steps, rows, n - n0, seconds - s0, forward - f0)

    def total(self) -> Tally:
        out = Tally()
        for t in self.tallies.values():
            out.add(t)
        return out


def label_of(spec: SpecConfig | None) -> str:
    """A short name for a table row: the method and its main settings (`+pl=K,n=N`: the trained
    drafter's lookup branch; `+pl=0` when it is off)."""
    base = _base_label(spec)
    if isinstance(spec, LookupBranchOptions):
        k, n = spec.prompt_lookup_num_tokens, spec.max_matching_ngram_size
        return f"{base}+pl={k}" + (f",n={n}" if k and n != 2 else "")
    return base


def _base_label(spec: SpecConfig | None) -> str:
    if spec is None:
        return "plain"
    if isinstance(spec, DraftModelConfig):
        window = f",window={spec.draft_window}" if spec.draft_window else ""
        vocab = f",vocab={spec.draft_vocab_size}" if spec.draft_vocab_size != "auto" else ""
        return f"draft_model[{spec.draft_model},k={spec.num_draft_tokens}{window}{vocab}]"
    if isinstance(spec, PromptLookupConfig):
        extra = f",draft={spec.draft_model}" if spec.draft_model else ""
        return f"prompt_lookup[k={spec.prompt_lookup_num_tokens},n={spec.max_matching_ngram_size}{extra}]"
    if isinstance(spec, LookaheadConfig):
        return f"lookahead[{spec.window_size},{spec.ngram_size},{spec.verification_set_size}]"
    if isinstance(spec, ReDrafterConfig):
        return f"redrafter[w={spec.beam_width},l={spec.beam_length}]"
    if isinstance(spec, Eagle2Config):
        return f"eagle2[d={spec.depth},k={spec.top_k},t={spec.total_tokens}]"
    return spec.method


class PeerRunner:
    """transformers on the same converted weights: plain greedy, prompt lookup, assistant model."""

    def __init__(self, llm: LLM) -> None:
        from transformers import AutoModelForCausalLM

        from specdecode.models.loader import resolve_model

        def load(name: str) -> Any:
            model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=llm.model.dtype)
            return model.to(llm.model.device).eval()

        self.load = load
        self.model = load(llm.model_name)
        self.assistants: dict[str, Any] = {}
        self.eos = llm.tokenizer.eos_token_ids
        self.device = llm.model.device

    def supports(self, spec: SpecConfig | None) -> bool:
        return (
            spec is None
            or isinstance(spec, DraftModelConfig)
            or (isinstance(spec, PromptLookupConfig) and spec.draft_model is None)
        )

    def run(self, ids: list[int], spec: SpecConfig | None, max_tokens: int) -> list[int]:
        kwargs: dict[str, Any] = {}
        if isinstance(spec, PromptLookupConfig):
            kwargs["prompt_lookup_num_tokens"] = spec.prompt_lookup_num_tokens
            kwargs["max_matching_ngram_size"] = spec.max_matching_ngram_size
        elif isinstance(spec, DraftModelConfig):
            if spec.draft_model not in self.assistants:
                self.assistants[spec.draft_model] = self.load(spec.draft_model)
            kwargs["assistant_model"] = self.assistants[spec.draft_model]
            kwargs["num_assistant_tokens"] = spec.num_draft_tokens
            kwargs["num_assistant_tokens_schedule"] = "constant"
        out = self.model.generate(
            torch.tensor([ids], device=self.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.eos[0],
            **kwargs,
        )
        tokens = out[0, len(ids) :].tolist()
        ends = [i for i, t in enumerate(tokens) if t in self.eos]
        return tokens[: ends[0] + 1] if ends else tokens

    @torch.inference_mode()
    def tie_gap(self, ids: list[int], theirs: list[int], ours: list[int]) -> float:
        """At the first position where two greedy outputs differ, transformers' logit of its token
        minus its logit of ours (one forward over the prompt and the common prefix), in rounding
        steps of the model's dtype at that logit: within a step or two is a near-tie, which
        another order of the same sums may break the other way."""
        d = next(i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b)
        logits = self.model(torch.tensor([ids + theirs[:d]], device=self.device)).logits[0, -1].float()
        top = float(logits[theirs[d]])
        step = torch.finfo(self.model.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))
        return (top - float(logits[ours[d]])) / step


def run(
    llm: LLM,
    specs: list[SpecConfig | None],
    questions: list[dict],
    max_tokens: int,
    temperature: float,
    peer: bool,
    progress: bool = True,
    desc: str = "spec-bench",
) -> list[Method]:
    from tqdm import tqdm

    methods = [Method(label_of(s), s) for s in specs]
    if peer:
        runner = PeerRunner(llm)
        methods += [Method("transformers:" + label_of(s), s, peer=True) for s in specs if runner.supports(s)]
    # Warm-up: first calls pay one-off costs (allocation, a draft model's load, on a GPU first
    # launches at new sizes: on an H200 the first summarization turn waited ~1.07 s for its first
    # token with plain decoding, which runs first, and 0.04-0.26 s with the methods after it), on
    # the longest prompt, then per method.
    longest = max((q["turns"][0] for q in questions), key=len)
    llm.generate([llm.chat_prompt([{"role": "user", "content": longest}])], SamplingParams(max_tokens=2))
    for m in methods:
        if not m.peer:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), speculative=m.spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    total = sum(len(q["turns"]) for q in questions)
    bar = tqdm(total=total, desc=desc, unit="turn", disable=not progress)
    for q in questions:
        cat = category_of(q)
        history: list[dict[str, str]] = []
        for turn in q["turns"]:
            history.append({"role": "user", "content": turn})
            ids = llm.chat_prompt(history)
            reference: list[int] | None = None
            for m in methods:
                tally = Tally(outputs=1)
                # Each run starts cold, as it would alone: no blocks reused from the previous
                # method's run of the same prompt (a prefill skipped, a drafter's prompt unseen).
                llm.engine.clear_prefix_cache()
                t0 = time.perf_counter()
                if m.peer:
                    tokens = runner.run(ids, m.spec, max_tokens)
                    tally.seconds = time.perf_counter() - t0
                    tally.forwards = 0
                else:
                    before = {rows: list(c) for rows, c in llm.engine.stats.decode_steps.items()}
                    out = llm.generate([ids], params, speculative=m.spec)[0]
                    tally.seconds = time.perf_counter() - t0
                    m.count_steps(before, llm.engine.stats.decode_steps)
                    tokens = out.token_ids
                    tally.forwards = out.stats.num_target_forwards
                    if len(tokens) > 1:
                        tally.decode_tokens = len(tokens) - 1
                        tally.decode_seconds = out.timing.total_s - out.timing.first_token_s
                tally.tokens = len(tokens)
                if reference is None:
                    reference = tokens  # plain decoding runs first
                tally.mismatches = int(temperature == 0 and tokens != reference)
                if m.peer and m.spec is None and tally.mismatches and len(tokens) > 1:
                    common = min(len(tokens), len(reference))
                    if tokens[:common] != reference[:common]:  # not one output ending early
                        m.tie_gaps.append(runner.tie_gap(ids, tokens, reference))
                m.tallies[cat].add(tally)
            history.append({"role": "assistant", "content": llm.tokenizer.decode(reference or [])})
            bar.update(1)
    bar.close()
    return methods


def report(methods: list[Method], temperature: float) -> dict[str, Any]:
    base = methods[0]
    cats = sorted(base.tallies)
    rows = []
    for m in methods:
        for cat in [*cats, "overall"]:
            t = m.total() if cat == "overall" else m.tallies[cat]
            b = base.total() if cat == "overall" else base.tallies[cat]
            rows.append(
                {
                    "method": m.label,
                    "category": cat,
                    "tokens_per_s": round(t.tok_s, 2),
                    "speedup": round(t.tok_s / b.tok_s, 3) if b.tok_s else None,
                    "decode_tokens_per_s": round(t.decode_tok_s, 2) if t.decode_tok_s else None,
                    "decode_speedup": round(t.decode_tok_s / b.decode_tok_s, 3)
                    if t.decode_tok_s and b.decode_tok_s
                    else None,
                    "tau": round(t.tau, 3) if not m.peer else None,
                    "greedy_match": (t.mismatches == 0) if temperature == 0 else None,
                    "mismatches": t.mismatches if temperature == 0 else None,
                    "outputs": t.outputs,
                    "tokens": t.tokens,
                }
            )
    gaps = {m.label: [round(g, 2) for g in m.tie_gaps] for m in methods if m.tie_gaps}
    steps = {m.label: step_rows(m.steps) for m in methods if m.steps}
    return {"temperature": temperature, "rows": rows, "tie_gaps": gaps, "steps": steps}


def add_steps(steps: dict[int, list[float]], rows: int, n: float, seconds: float, forward: float) -> None:
    """Add n steps of `rows` rows, `seconds` in all and `forward` of them in the target's
    forward, to the counts `steps` ([steps, seconds, forward seconds])."""
    counts = steps.setdefault(rows, [0, 0.0, 0.0])
    counts[0] += n
    counts[1] += seconds
    counts[2] += forward


def step_rows(steps: dict[int, list[float]]) -> list[dict[str, float]]:
    """Decoding steps by rows in their forward: how many, their mean milliseconds, and the mean
    milliseconds of their target forward."""
    return [
        {"rows": rows, "steps": int(n), "ms": round(1000 * s / n, 3), "forward_ms": round(1000 * f / n, 3)}
        for rows, (n, s, f) in sorted(steps.items())
    ]


# A run's figures that are medians over repeated runs (each ratio taken within its run first).
MEDIAN_KEYS = ("tokens_per_s", "speedup", "decode_tokens_per_s", "decode_speedup", "tau")


def median_report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs of the same methods over the same questions: each figure
    the median of the runs' (a speedup is a ratio within its run, then the median of those),
    greedy outputs matching only where they matched in every run, counts summed, and each row's
    spread of speedups over the runs (`speedup_runs`, `decode_speedup_runs`). On a machine whose
    speed drifts between runs, the within-run ratios' median is the figure to quote."""
    rows = []
    for i, first in enumerate(results[0]["rows"]):
        same = [r["rows"][i] for r in results]
        assert all((r["method"], r["category"]) == (first["method"], first["category"]) for r in same)
        row = dict(first)
        for key in MEDIAN_KEYS:
            values = [r[key] for r in same if r[key] is not None]
            row[key] = round(statistics.median(values), 3) if values else None
        for key in ("speedup", "decode_speedup"):
            row[key + "_runs"] = [r[key] for r in same]
        if first["greedy_match"] is not None:
            row["mismatches"] = sum(r["mismatches"] for r in same)
            row["greedy_match"] = row["mismatches"] == 0
        row["outputs"] = sum(r["outputs"] for r in same)
        row["tokens"] = sum(r["tokens"] for r in same)
        rows.append(row)
    gaps: dict[str, list[float]] = {}
    for r in results:
        for label, g in r["tie_gaps"].items():
            gaps.setdefault(label, []).extend(g)
    steps: dict[str, dict[int, list[float]]] = {}  # every run's steps together
    for r in results:
        for label, by_rows in r.get("steps", {}).items():
            mine = steps.setdefault(label, {})
            for s in by_rows:
                n = s["steps"]
                add_steps(mine, s["rows"], n, n * s["ms"] / 1000, n * s["forward_ms"] / 1000)
    merged = {label: step_rows(by_rows) for label, by_rows in steps.items()}
    return {
        "temperature": results[0]["temperature"],
        "rows": rows,
        "tie_gaps": gaps,
        "steps": merged,
        "runs": len(results),
    }


def machine(llm: LLM) -> dict[str, Any]:
    """What the figures ran on: the kernels (named for the instruction set they were built for,
    e.g. `cpu-avx512`), the quantized products' kernels and threads (`main_args` adds the memory's
    read bandwidth before and after the run: a host whose other tenants take its bandwidth slows
    one-row steps more than verified rows, so its ratios read higher)."""
    kernels = llm.model.kernels
    return {
        "kernels": kernels.name,
        "quant_kernels": kernels.quant.name if kernels.quant is not None else None,
        "threads": torch.get_num_threads(),
    }


def read_gb_s(llm: LLM) -> float | None:
    """The memory's read bandwidth now, GB/s (the kernels' probe; None off our CPU kernels)."""
    probe = llm.model.kernels.probe
    return None if probe is None else round(probe.read_bandwidth(torch.get_num_threads()) / 1e9, 1)


def machine_line(m: dict[str, Any]) -> str:
    quant = f" (quantized products: {m['quant_kernels']})" if m["quant_kernels"] else ""
    line = f"kernels {m['kernels']}{quant}, {m['threads']} threads"
    if m["read_gb_s"] is not None:
        line += f"; memory read {m['read_gb_s']} GB/s before the run, {m['read_gb_s_after']} after"
    return line


def print_table(result: dict[str, Any]) -> None:
    """Tokens/s and speedup over the whole request (prefill included), then over decoding alone
    (after the first token; `decode`)."""
    print(
        f"{'method':<52} {'category':<15} {'tok/s':>8} {'speedup':>8} {'decode':>8} {'speedup':>8} "
        f"{'tau':>6} {'match':>6}"
    )
    for r in result["rows"]:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        match = "" if r["greedy_match"] is None else ("yes" if r["greedy_match"] else f"NO {r['mismatches']}")
        decode = "" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.2f}"
        decode_x = "" if r["decode_speedup"] is None else f"{r['decode_speedup']:.2f}x"
        print(
            f"{r['method']:<52} {r['category']:<15} {r['tokens_per_s']:>8.2f} "
            f"{r['speedup'] or 0:>7.2f}x {decode:>8} {decode_x:>8} {tau:>6} {match:>6}"
        )
    runs = result.get("runs", 1)
    if runs > 1:
        print(f"medians of {runs} runs (each speedup a ratio within its run); overall speedups per run:")
        for r in result["rows"]:
            if r["category"] == "overall" and r["method"] != "plain":
                whole = " ".join(f"{v:.2f}x" for v in r["speedup_runs"] if v is not None)
                alone = " ".join(f"{v:.2f}x" for v in r["decode_speedup_runs"] if v is not None)
                print(f"  {r['method']}: {whole}" + (f" (decoding alone {alone})" if alone else ""))
    if result.get("steps"):
        print(
            "decoding steps by rows in their forward (steps x mean ms of a step [of it the target forward]):"
        )
        for label, by_rows in result["steps"].items():
            line = ", ".join(
                f"{s['rows']}: {s['steps']} x {s['ms']:.2f} [{s['forward_ms']:.2f}]" for s in by_rows
            )
            print(f"  {label}: {line}")
    for label, gaps in result.get("tie_gaps", {}).items():
        print(
            f"{label} differs from ours on {len(gaps)} outputs: at the first token that differs its "
            f"own logits put its token above ours by {gaps} rounding steps of the dtype"
        )


def plot(result: dict[str, Any], file: str) -> None:
    """Speedup over plain decoding per category and method: whole requests, then decoding alone."""
    from specdecode.bench.plots import Panel, draw

    rows = [r for r in result["rows"] if r["method"] != "plain"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    categories = list(dict.fromkeys(r["category"] for r in rows))
    value = {(r["method"], r["category"]): r for r in rows}

    def series(key: str) -> list[tuple[str, list[float]]]:
        return [(m, [value[m, c][key] or 0.0 for c in categories]) for m in methods]

    draw(
        file,
        [
            Panel("speedup over plain decoding (whole requests)", categories, series("speedup"), 1.0),
            Panel("speedup over plain decoding (decoding alone)", categories, series("decode_speedup"), 1.0),
        ],
    )


def specs_from_args(args: argparse.Namespace) -> list[SpecConfig | None]:
    specs: list[SpecConfig | None] = [None]
    for name in args.method or []:
        options = {"draft_model": args.draft_model} if name == "draft_model" else {}
        specs.append(parse_speculative({"method": name, **options}))
    for text in args.spec or []:
        try:
            specs.append(parse_speculative(json.loads(text)))
        except json.JSONDecodeError:
            raise SpecDecodeError(f"--spec must be a JSON object, got {text!r}") from None
    return specs


def main_args(args: argparse.Namespace) -> None:
    require_positive(args, "repeats")
    specs = specs_from_args(args)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        activations=args.activations,
        device=args.device,
        num_threads=args.threads,
        speculation_policy=args.policy,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    questions = load_questions(args.questions, args.per_category or None, args.categories)
    ran_on = machine(llm) | {"read_gb_s": read_gb_s(llm)}
    results = []
    for i in range(args.repeats):
        desc = "spec-bench" if args.repeats == 1 else f"spec-bench run {i + 1}/{args.repeats}"
        methods = run(llm, specs, questions, args.max_tokens, args.temperature, args.transformers, desc=desc)
        results.append(report(methods, args.temperature))
    result = results[0] if len(results) == 1 else median_report(results)
    ran_on["read_gb_s_after"] = read_gb_s(llm)
    result.update(model=args.model, max_tokens=args.max_tokens, questions=len(questions), machine=ran_on)
    print(machine_line(ran_on))
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
        print(f"plot written to {args.plot}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench format question.jsonl")
    p.add_argument("--per-category", type=int, default=2, help="questions per category (0 = all)")
    p.add_argument(
        "--categories", nargs="*", default=None, help="e.g. mt_bench summarization; coding (MT-Bench's alone)"
    )
    p.add_argument("--method", action="append", help="a method with default options (repeatable)")
    p.add_argument("--draft-model", default=None, help="draft model for --method draft_model")
    p.add_argument("--spec", action="append", help='a full setting as JSON, e.g. \'{"method": "lookahead"}\'')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the questions N times (every method per turn each time) and report medians",
    )
    p.add_argument(
        "--no-policy",
        dest="policy",
        action="store_false",
        help="every step drafts the method's whole proposal (the load policy off)",
    )
    p.add_argument("--transformers", action="store_true", help="also time transformers on the same prompts")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw each method's speedups to this PNG (needs matplotlib)"
    )
