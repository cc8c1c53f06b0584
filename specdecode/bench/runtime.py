"""Plain greedy decoding speed: specdecode vs transformers `generate`, and the forward-latency curve.

Both run in this process, on the same weights (our converted directory), dtype and threads;
runs alternate between the two so that machine noise hits both alike, and medians are reported.

    specdecode bench-runtime --model smollm2-135m --new-tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError, require_positive
from specdecode.llm import LLM
from specdecode.models.latency import forward_seconds
from specdecode.sampling import SamplingParams

PROMPT = "Write a short essay about the history of the printing press and its effect on science."
LATENCY_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
DEPTH = 256  # cached tokens the forward-latency curve is timed after, unless asked otherwise


@dataclass(frozen=True)
class Machine:
    """What bounds a forward here: the bytes and parameters of the matrices it multiplies (every
    layer and the LM head), the memory's read bandwidth (bytes/s) and the kernels' peak FLOP/s
    (their fused multiply-adds alone) and int8 ops/s (their int8 dot products alone, None where
    they have none), with the kernels' name (their instruction set)."""

    kernels: str
    weight_bytes: int
    weight_params: int
    bandwidth: float
    peak_flops: float
    peak_int8_ops: float | None = None

    def peak(self, activations: str) -> float:
        """The arithmetic rate that bounds products of `activations` (float32, or int8 where
        the kernels multiply int8)."""
        return self.peak_int8_ops if activations == "int8" and self.peak_int8_ops else self.peak_flops


@dataclass(frozen=True)
class Memory:
    """Resident memory (MB) before and after the model was loaded (its KV cache is reserved but
    not yet touched), and the size of the model's file (a GGUF) where there is one."""

    rss_before_mb: float
    rss_after_mb: float
    file_mb: float | None


def rss_mb() -> float | None:
    """This process's resident memory in MB (Linux; None elsewhere)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def machine(llm: LLM) -> Machine | None:
    """The bounds of `llm`'s model here, or None where it does not run on our CPU kernels."""
    from specdecode.layers.linear import Dense

    kernels = llm.model.kernels
    if kernels.probe is None:
        return None
    threads = torch.get_num_threads()
    nbytes = params = 0
    for dense in (m for m in llm.model.modules() if isinstance(m, Dense)):
        w = dense.quantized
        nbytes += w.nbytes if w is not None else sum(p.numel() * p.element_size() for p in dense.parameters())
        params += w.in_features * w.out_features if w is not None else dense.matrix().numel()
    if llm.model.lm_head is None:  # a tied float head: the embedding, read transposed
        head = llm.model.head_weight_t()
        nbytes, params = nbytes + head.numel() * head.element_size(), params + head.numel()
    probe = kernels.probe
    return Machine(
        kernels.name,
        nbytes,
        params,
        probe.read_bandwidth(threads),
        probe.peak_flops(threads),
        probe.peak_int8_ops(threads),
    )


@dataclass
class RuntimeReport:
    model: str
    dtype: str
    threads: int
    new_tokens: int
    activations: str = "float32"  # int8: rounded as llama.cpp does, tokens no longer transformers' own
    # The forward-latency curve by the cached tokens it is timed after (llama-bench's depth),
    # the first depth's being the curve the bounds are read against.
    forward_ms_by_context: dict[int, dict[int, float]] = field(default_factory=dict)
    ours_tok_s: list[float] = field(default_factory=list)
    hf_tok_s: list[float] = field(default_factory=list)
    # On a GPU: ours with every forward launched op by op (no CUDA graphs), and transformers with
    # its static cache and `torch.compile` (mode "reduce-overhead": its own CUDA graphs).
    ours_eager_tok_s: list[float] = field(default_factory=list)
    hf_compiled_tok_s: list[float] = field(default_factory=list)
    graph_forward_ms: dict[int, float] = field(default_factory=dict)
    same_tokens: bool = False
    machine: Machine | None = None
    memory: Memory | None = None

    @property
    def context(self) -> int:
        """The cached tokens of the first curve (`DEPTH` unless asked otherwise)."""
        return next(iter(self.forward_ms_by_context), DEPTH)

    @property
    def forward_ms(self) -> dict[int, float]:
        """The forward-latency curve after `context` cached tokens: ms by new tokens."""
        return self.forward_ms_by_context.get(self.context, {})

    def depth_cost_ms(self, context: int) -> dict[int, float]:
        """What a forward after `context` cached tokens costs beyond one after the first curve's,
        by new tokens: attention over the extra tokens (the products do not depend on them)."""
        return {t: round(ms - self.forward_ms[t], 2) for t, ms in self.forward_ms_by_context[context].items()}

    def bounds_ms(self, rows: int) -> tuple[float, float] | None:
        """(memory bound, compute bound) of a forward over `rows` new tokens, in ms."""
        m = self.machine
        if m is None:
            return None
        compute = rows * 2 * m.weight_params / m.peak(self.activations)
        return 1000 * m.weight_bytes / m.bandwidth, 1000 * compute

    @property
    def ratio(self) -> float:
        return statistics.median(self.ours_tok_s) / statistics.median(self.hf_tok_s)

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "activations": self.activations,
            "threads": self.threads,
            "new_tokens": self.new_tokens,
            "specdecode_tok_s_median": round(statistics.median(self.ours_tok_s), 2),
            "transformers_tok_s_median": round(statistics.median(self.hf_tok_s), 2),
            "speedup": round(self.ratio, 3),
            "specdecode_tok_s_runs": [round(x, 2) for x in self.ours_tok_s],
            "transformers_tok_s_runs": [round(x, 2) for x in self.hf_tok_s],
            "same_tokens": self.same_tokens,
            "specdecode_eager_tok_s_runs": [round(x, 2) for x in self.ours_eager_tok_s],
            "transformers_compiled_tok_s_runs": [round(x, 2) for x in self.hf_compiled_tok_s],
            "forward_context": self.context,
            "forward_ms_by_new_tokens": self.forward_ms,
            "forward_ms_by_context": self.forward_ms_by_context,
            "graph_forward_ms_by_new_tokens": self.graph_forward_ms,
            "bounds_ms_by_new_tokens": {t: self.bounds_ms(t) for t in self.forward_ms},
            "machine": None if self.machine is None else dataclasses.asdict(self.machine),
            "memory": None if self.memory is None else dataclasses.asdict(self.memory),
        }


def latency_context(llm: LLM, widths: tuple[int, ...], context: int = DEPTH) -> int:
    """The cached tokens the forward-latency curve is timed after: `context`, or fewer where the
    model's positions would not hold them and the widest forward."""
    return max(1, min(context, llm.model.config.max_position_embeddings - max(widths)))


def forward_latency(
    llm: LLM, widths: tuple[int, ...], context: int = DEPTH, repeats: int = 10
) -> dict[int, float]:
    """Median ms of one target forward of T new tokens over `context` plus the greedy LM head on
    every row, as a greedy verification step reads it."""
    seconds = forward_seconds(llm.model, list(widths), context, repeats)
    return {t: round(1000 * statistics.median(s), 2) for t, s in seconds.items()}


def compiled(hf: torch.nn.Module) -> torch.nn.Module:
    """transformers' recipe for fast decoding on a GPU: a static KV cache, with which `generate`
    compiles the decoding forward itself (`torch.compile`, mode "reduce-overhead": CUDA graphs).
    Wrapping `forward` in a second `torch.compile` on top breaks that (transformers 5.17: its
    graphs' outputs are overwritten under the cache's update)."""
    hf.generation_config.cache_implementation = "static"
    return hf


def run(
    model: str,
    dtype: str,
    new_tokens: int,
    repeats: int,
    threads: int | None,
    device: str | None = None,
    compile_peer: bool = False,
    activations: str = "float32",
    depths: tuple[int, ...] = (DEPTH,),
) -> RuntimeReport:
    """Time plain decoding against transformers on the same weights, then the forward-latency
    curve after each of `depths` cached tokens (each as `latency_context` allows; the first is
    the curve the bounds and CUDA graphs are read at)."""
    import copy

    from transformers import AutoModelForCausalLM

    from specdecode.models.loader import resolve_model

    if threads:
        torch.set_num_threads(threads)
    # Loading first runs ops on the meta device, whose machinery costs ~75 MB of resident memory
    # once per process: warmed first, so that the difference is the model's own.
    torch.outer(torch.arange(4, device="meta").float(), torch.ones(2, device="meta")).cos()
    before = rss_mb()
    llm = LLM(model=model, dtype=dtype, device=device, activations=activations)
    after = rss_mb()
    gpu = llm.model.device.type == "cuda"
    # The model's dtype (a GGUF run as stored computes in float32: transformers runs the same
    # weights dequantized).
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=llm.model.dtype)
    hf = hf.to(llm.model.device).eval()
    hf_fast = compiled(copy.deepcopy(hf)) if gpu and compile_peer else None
    eager = llm.new_engine(dataclasses.replace(llm.engine.config, cuda_graphs=False)) if gpu else None
    ids = llm.chat_prompt([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    report = RuntimeReport(model, dtype, torch.get_num_threads(), new_tokens, activations)
    input_ids = torch.tensor([ids], device=llm.model.device)

    def ours() -> list[int]:
        return llm.generate([ids], params)[0].token_ids

    def ours_eager() -> list[int]:
        engine, llm.engine = llm.engine, eager
        try:
            return llm.generate([ids], params)[0].token_ids
        finally:
            llm.engine = engine

    def generate(m: torch.nn.Module) -> list[int]:
        out = m.generate(  # type: ignore[operator]
            input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        return out[0, len(ids) :].tolist()

    runs = [(ours, report.ours_tok_s), (lambda: generate(hf), report.hf_tok_s)]
    if gpu:
        runs.append((ours_eager, report.ours_eager_tok_s))
    if hf_fast is not None:
        runs.append((lambda: generate(hf_fast), report.hf_compiled_tok_s))
    for fn, _ in runs:  # warm-up (and compilation)
        fn()
    for _ in range(repeats):
        for fn, sink in runs:
            for engine in (llm.engine, eager):
                if engine is not None:  # each run prefills its prompt, as transformers' does
                    engine.clear_prefix_cache()
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = fn()
            sink.append(len(tokens) / (time.perf_counter() - t0))
    # min_new_tokens masks end-of-sequence in transformers, ignore_eos in ours: same rule, same tokens
    report.same_tokens = ours() == generate(hf)
    for depth in depths:
        context = latency_context(llm, LATENCY_WIDTHS, depth)
        if context not in report.forward_ms_by_context:
            report.forward_ms_by_context[context] = forward_latency(llm, LATENCY_WIDTHS, context)
    if llm.engine.graphs is not None:
        seconds = llm.engine.graphs.seconds(list(LATENCY_WIDTHS), report.context, 20)
        report.graph_forward_ms = {t: round(1000 * statistics.median(s), 3) for t, s in seconds.items()}
    report.machine = machine(llm)
    if before is not None and after is not None:
        report.memory = Memory(round(before, 1), round(after, 1), file_mb(model))
    return report


def file_mb(model: str) -> float | None:
    """The size of the model's GGUF file in MB, where it is one."""
    from specdecode.models.registry import REGISTRY, gguf_path

    path = gguf_path(model) if model in REGISTRY else Path(model)
    return round(path.stat().st_size / 2**20, 1) if path.suffix == ".gguf" and path.is_file() else None


def print_report(report: RuntimeReport) -> None:
    d = report.as_dict()
    print(
        f"model {report.model}  dtype {report.dtype}  activations {report.activations}  "
        f"threads {report.threads}  tokens {report.new_tokens}"
    )
    print(f"  specdecode    {d['specdecode_tok_s_median']:>8} tok/s  (runs {d['specdecode_tok_s_runs']})")
    print(f"  transformers  {d['transformers_tok_s_median']:>8} tok/s  (runs {d['transformers_tok_s_runs']})")
    rounded = " (int8 activations: not expected)" if report.activations == "int8" else ""
    print(f"  speedup       {d['speedup']:>8}x    same greedy tokens: {report.same_tokens}{rounded}")
    if report.ours_eager_tok_s:
        eager = statistics.median(report.ours_eager_tok_s)
        runs = d["specdecode_eager_tok_s_runs"]
        print(f"  specdecode without CUDA graphs       {eager:>8.2f} tok/s  (runs {runs})")
    if report.hf_compiled_tok_s:
        fast = statistics.median(report.hf_compiled_tok_s)
        ours = d["specdecode_tok_s_median"]
        print(f"  transformers static cache + compile  {fast:>8.2f} tok/s  (ours {ours / fast:.2f}x)")
    print(f"  forward + greedy LM head latency (ms) by new tokens over a {report.context}-token context:")
    print("    " + "  ".join(f"T={t}: {ms}" for t, ms in report.forward_ms.items()))
    for context, curve in list(report.forward_ms_by_context.items())[1:]:
        extra = report.depth_cost_ms(context)
        print(f"  the same over a {context}-token context, and beyond the {report.context}-token one:")
        print("    " + "  ".join(f"T={t}: {ms} ({extra[t]:+})" for t, ms in curve.items()))
    if report.graph_forward_ms:
        print("  the same from captured CUDA graphs (ms):")
        print("    " + "  ".join(f"T={t}: {ms}" for t, ms in report.graph_forward_ms.items()))
    m = report.machine
    if m is not None:
        peak = f"peak {m.peak_flops / 1e9:.0f} GFLOP/s float32"
        if report.activations == "int8":
            int8 = m.peak_int8_ops
            peak += (
                f", {int8 / 1e9:.0f} G int8 ops/s (the bound)" if int8 else " (no int8 products: the bound)"
            )
        print(
            f"  bounds ({m.kernels} kernels, {m.weight_bytes / 1e6:.1f} MB of {m.weight_params / 1e6:.1f}M"
            f" weights read at {m.bandwidth / 1e9:.1f} GB/s, {peak}):"
        )
        for t, ms in (report.graph_forward_ms or report.forward_ms).items():
            mem, comp = report.bounds_ms(t)  # type: ignore[misc]
            over = ms / max(mem, comp)
            print(f"    T={t}: {ms} ms  memory bound {mem:.3f}  compute bound {comp:.3f} ({over:.2f}x bound)")
        mem, _ = report.bounds_ms(1)  # type: ignore[misc]
        share = d["specdecode_tok_s_median"] * mem / 1000
        print(f"  plain decoding at {100 * share:.1f}% of the memory bound ({1000 / mem:.0f} tok/s)")
    if report.memory is not None:
        mem = report.memory
        file = f", file {mem.file_mb} MB" if mem.file_mb is not None else ""
        print(f"  resident memory: {mem.rss_before_mb} MB before loading, {mem.rss_after_mb} MB after{file}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--compile",
        action="store_true",
        help="on a GPU, also time transformers with its static cache and torch.compile (minutes to compile)",
    )
    p.add_argument(
        "--depth",
        type=int,
        action="append",
        metavar="N",
        help="cached tokens the forward-latency curve is timed after (llama-bench's depth; default "
        "256); repeat for a curve at each, the first read against the bounds",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")


def main_args(args: argparse.Namespace) -> None:
    require_positive(args, "new_tokens", "repeats")
    depths = tuple(args.depth or (DEPTH,))
    if any(d < 1 for d in depths):
        raise SpecDecodeError(f"--depth must be >= 1, got {min(depths)}")
    report = run(
        args.model, args.dtype, args.new_tokens, args.repeats, args.threads, args.device, args.compile,
        args.activations, depths,
    )  # fmt: skip
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report.as_dict(), fh, indent=2)
