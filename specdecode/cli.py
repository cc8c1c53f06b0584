"""Command line: `specdecode generate | serve | models list | models fetch | bench | bench-runtime | train`.

Bad input is reported as one line on stderr (`specdecode: error: ...`) with exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:  # the heavy imports (torch) wait until a command needs them
    from specdecode.engine.config import EngineConfig
    from specdecode.llm import LLM
    from specdecode.sampling import SamplingParams

DEFAULT_MODEL = "smollm2-135m"
TRAIN_METHODS = {  # `specdecode train METHOD`: the module specdecode.train.METHOD
    "medusa": "Medusa heads (Cai et al. 2024) from ShareGPT conversations",
    "redrafter": "a ReDrafter (Cheng et al. 2024) from ShareGPT data",
    "eagle": "an EAGLE head (Li et al. 2024) from ShareGPT conversations",
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        default=None,
        help="q4_0, q4_1, q5_0 or q8_0: a float checkpoint's weights quantized on load (CPU)",
    )


def add_activations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--activations",
        default="float32",
        choices=["float32", "int8"],
        help="int8: block-format products round their inputs to int8 per group of 32, as llama.cpp "
        "does (faster; outputs no longer those of the dequantized weights)",
    )


def add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "float16"],
        help="what the KV cache keeps keys and values in: auto (the model's dtype) or float16 (half "
        "the bytes, as llama.cpp's default; CPU)",
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, .gguf file, HF directory or hub id")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: on a CPU a GGUF's weights as stored (quantized, float32 activations), else "
        "float32; on a GPU bfloat16",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA when available)")
    p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for torch")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0, as vLLM)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _lookahead(text: str) -> tuple[int, int, int]:
    try:
        w, n, g = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W,N,G (three integers), got {text!r}") from None
    return w, n, g


def _vocab_size(text: str) -> int | str:
    """--draft-vocab-size: a number of ids, or "auto" / "all" (checked with the other settings)."""
    return int(text) if text.lstrip("-").isdigit() else text


def _json_arg(text: str, kinds: type | tuple[type, ...], expected: str) -> object:
    """`text` parsed as JSON of one of `kinds`, else an argparse error saying what was expected."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not isinstance(value, kinds):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _choices_json(text: str) -> list[list[int]]:
    return _json_arg(text, list, "a JSON list of lists such as [[0],[0,0],[1]]")  # type: ignore[return-value]


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (options of other methods are an error)")
    g.add_argument(
        "--method",
        choices=[
            "none",
            "draft_model",
            "prompt_lookup",
            "lookahead",
            "medusa",
            "redrafter",
            "eagle",
            "eagle2",
        ],
        default=None,
    )
    g.add_argument("--draft-model", default=None, help="draft_model / prompt_lookup: the draft model")
    g.add_argument("--num-draft-tokens", "--max-draft-len", type=int, default=None, dest="num_draft_tokens")
    g.add_argument("--use-draft-logits", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--draft-dtype",
        default=None,
        help="draft_model / prompt_lookup: auto (default), stored, float32, bfloat16, "
        "or q4_0 / q4_1 / q5_0 / q8_0 (quantized on load)",
    )
    g.add_argument(
        "--draft-window",
        type=int,
        default=None,
        help="draft_model / prompt_lookup: the draft reads only each prompt's last N tokens (default: all)",
    )
    g.add_argument(
        "--draft-vocab-size",
        type=_vocab_size,
        default=None,
        metavar="N|auto|all",
        help="draft_model / prompt_lookup: the draft proposes only token ids below N "
        "(default auto: 32768 for a vocabulary over 65536)",
    )
    g.add_argument("--prompt-lookup-num-tokens", type=int, default=None)
    g.add_argument("--max-matching-ngram-size", type=int, default=None)
    g.add_argument("--lookahead", type=_lookahead, default=None, metavar="W,N,G")
    g.add_argument(
        "--heads", default=None, help="medusa: heads directory (default: those shipped for the model)"
    )
    g.add_argument(
        "--medusa-choices", type=_choices_json, default=None, metavar="JSON", help="medusa: the tree"
    )
    g.add_argument(
        "--typical-acceptance",
        action="store_true",
        default=None,
        help="medusa: typical acceptance when sampling (LOSSY: output no longer follows the model)",
    )
    g.add_argument(
        "--posterior-threshold", type=float, default=None, help="medusa: typical acceptance epsilon"
    )
    g.add_argument("--posterior-alpha", type=float, default=None, help="medusa: typical acceptance delta")
    g.add_argument(
        "--head",
        default=None,
        help="redrafter / eagle / eagle2: head directory (default: the one shipped for the model)",
    )
    g.add_argument("--beam-width", type=int, default=None, help="redrafter: beams searched")
    g.add_argument("--beam-length", type=int, default=None, help="redrafter: tokens per beam, root included")
    g.add_argument(
        "--eagle-choices", type=_choices_json, default=None, metavar="JSON", help="eagle: the static tree"
    )
    g.add_argument("--depth", type=int, default=None, help="eagle2: levels of the dynamic tree")
    g.add_argument(
        "--top-k-draft", type=int, default=None, dest="top_k_draft", help="eagle2: nodes expanded per level"
    )
    g.add_argument("--total-tokens", type=int, default=None, help="eagle2: draft nodes verified")


MEDUSA_OPTIONS = ("heads", "medusa_choices", "typical_acceptance", "posterior_threshold", "posterior_alpha")
BEAM_OPTIONS = ("beam_width", "beam_length")  # redrafter's own; --head is shared by one-head methods
EAGLE2_OPTIONS = ("depth", "top_k", "total_tokens")  # --top-k-draft: --top-k is sampling's


def speculative_settings(args: argparse.Namespace) -> dict[str, object] | None:
    """The `speculative` dictionary of the flags given (validated later, in one place)."""
    spec: dict[str, object] = {}
    for name in (
        "draft_model",
        "num_draft_tokens",
        "use_draft_logits",
        "draft_dtype",
        "draft_window",
        "draft_vocab_size",
        "prompt_lookup_num_tokens",
        "max_matching_ngram_size",
        *MEDUSA_OPTIONS,
        "head",
        *BEAM_OPTIONS,
        "eagle_choices",
        "depth",
        "total_tokens",
    ):
        if getattr(args, name) is not None:
            spec[name] = getattr(args, name)
    if getattr(args, "top_k_draft", None) is not None:
        spec["top_k"] = args.top_k_draft
    if args.lookahead is not None:
        spec["window_size"], spec["ngram_size"], spec["verification_set_size"] = args.lookahead
    method = args.method
    if method is None and spec:
        if args.lookahead is not None:
            method = "lookahead"
        elif any(name in spec for name in MEDUSA_OPTIONS):
            method = "medusa"
        elif any(name in spec for name in BEAM_OPTIONS):
            method = "redrafter"
        elif "eagle_choices" in spec:
            method = "eagle"
        elif any(name in spec for name in EAGLE2_OPTIONS):
            method = "eagle2"
    if method is None and not spec:
        return None
    return {"method": method, **spec}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from specdecode.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _load_llm(args: argparse.Namespace, speculative: object) -> LLM:
    """The `LLM` that `generate` and `serve` run, from their model flags."""
    from specdecode.llm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        activations=args.activations,
        device=args.device,
        speculative=speculative,
        num_threads=args.threads,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from specdecode.spec_config import parse_speculative

    params = sampling_params(args)  # validate before the (slow) model load
    spec = parse_speculative(speculative_settings(args))
    llm = _load_llm(args, spec)
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    if args.stream and not args.json:
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    out = llm.generate([prompt], params)[0]
    if args.json:
        record = out.as_dict()
        record["prompt"] = args.prompt
        record["model"] = args.model
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(out.text)


def cmd_models_list(args: argparse.Namespace) -> None:
    from specdecode.models.registry import list_models

    for info in list_models():
        state = "fetched" if info.fetched else "not fetched"
        print(f"{info.name:<22} {info.size / 1e6:>8.1f} MB  {state:<12} {info.description}")


def cmd_models_fetch(args: argparse.Namespace) -> None:
    from specdecode.models.loader import resolve_model

    for name in args.names:
        print(resolve_model(name, progress=True))


def _main_of(module: str) -> Callable[[argparse.Namespace], None]:
    """The command `module.main_args`, imported only when it runs: benchmarks and training pull
    in modules (datasets, the training loop) that `generate` and `serve` never need."""

    def run(args: argparse.Namespace) -> None:
        importlib.import_module(module).main_args(args)

    return run


def _train_of(method: str) -> Callable[[argparse.Namespace], None]:
    """The command `specdecode train METHOD`."""

    def run(args: argparse.Namespace) -> None:
        from specdecode.train import pipeline

        pipeline.run_method(importlib.import_module(f"specdecode.train.{method}"), args)

    return run


def _speculative_json(text: str) -> dict[str, object] | None:
    expected = 'JSON such as {"method": "prompt_lookup"} (an object, or null)'
    return _json_arg(text, (dict, type(None)), expected)  # type: ignore[return-value]


MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
MEMORY_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30}


def _memory_size(text: str) -> int:
    """Bytes from `4GiB`, `512MB` or a plain number of bytes."""
    number = text.strip().lower().rstrip("kmgib")
    unit = text.strip().lower()[len(number) :]
    try:
        size = int(float(number) * MEMORY_UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 4GiB, 512MB or 1000000, got {text!r}"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return size


def cmd_serve(args: argparse.Namespace) -> None:
    from specdecode.engine.config import EngineConfig
    from specdecode.serving.server import serve

    config = EngineConfig(  # validate before the (slow) model load
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        policy=args.policy,
        speculative=args.speculative,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    scale_out = (args.replicas, args.min_replicas, args.max_replicas, args.ray_address) != (None,) * 4
    if scale_out:
        _serve_on_ray(args, config)
        return
    llm = _load_llm(args, config.speculative)
    serve(llm, config, host=args.host, port=args.port, api_key=args.api_key)


def _serve_on_ray(args: argparse.Namespace, config: EngineConfig) -> None:
    """`serve --replicas`: the engine as Ray Serve replicas behind one ingress."""
    try:
        from specdecode.distributed import serve as ray_serve
    except ImportError as exc:
        raise SpecDecodeError(
            f"--replicas needs Ray Serve ({exc.name} is missing): pip install 'specdecode[ray]'"
        ) from None
    gpus = 1.0 if (args.device or "").startswith("cuda") else 0.0
    settings = ray_serve.ServeSettings(
        model=args.model,
        engine=config,
        dtype=args.dtype,
        quantization=args.quantization,
        activations=args.activations,
        device=args.device,
        threads=args.threads or 1,
        gpus=gpus,
        replicas=args.replicas or args.min_replicas or 1,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        api_key=args.api_key,
    )
    ray_serve.run(settings, args.host, args.port, args.ray_address)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(gen)
    add_quantization_arg(gen)
    add_activations_arg(gen)
    add_kv_cache_arg(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(gen)
    add_speculative_args(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print text, token ids, timing and stats as JSON")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or fetch the models known by short name")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="known short names").set_defaults(func=cmd_models_list)
    fetch = msub.add_parser("fetch", help="download, check and convert a model")
    fetch.add_argument("names", nargs="+", metavar="NAME")
    fetch.set_defaults(func=cmd_models_fetch)
    benchmarks = {  # `specdecode COMMAND`: specdecode.bench.MODULE's add_args and main_args
        "bench": ("specbench", "Spec-Bench: plain decoding vs speculative methods, per category"),
        "bench-runtime": ("runtime", "plain decoding speed vs transformers, forward latency"),
        "bench-serve": (
            "serve",
            "serving engine under load: tok/s and TTFT vs streams, speculation off/on/policy",
        ),
        "bench-offline": ("offline", "LLM.generate throughput: many prompts in one call vs one call each"),
        "bench-peer": ("peer", "specdecode against llama.cpp on the same GGUF (needs the [peer] extra)"),
        "bench-scale": (
            "scale",
            "Ray Serve replicas behind the ingress vs one server, over HTTP ([ray] extra)",
        ),
        "bench-data": ("data", "Ray Data batch generation across workers vs one LLM.generate ([ray] extra)"),
    }
    for command, (name, about) in benchmarks.items():
        module = f"specdecode.bench.{name}"
        bench = sub.add_parser(command, help=about)
        add_model_args(bench)
        if name in ("specbench", "peer", "runtime"):  # the benchmarks that time one model's runs
            add_activations_arg(bench)
            add_kv_cache_arg(bench)
        importlib.import_module(module).add_args(bench)
        bench.set_defaults(func=_main_of(module))

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (in-flight batching, speculation)")
    add_model_args(srv)
    add_quantization_arg(srv)
    add_activations_arg(srv)
    add_kv_cache_arg(srv)
    srv.add_argument(
        "--speculative",
        type=_speculative_json,
        default=None,
        metavar="JSON",
        help='method for requests that do not choose, e.g. \'{"method": "prompt_lookup"}\' (default: plain)',
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    ray_args = srv.add_argument_group("scale-out on Ray Serve (the [ray] extra)")
    ray_args.add_argument(
        "--replicas", type=_positive_int, default=None, help="engine replicas (--threads each)"
    )
    ray_args.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    ray_args.add_argument(
        "--max-replicas", type=_positive_int, default=None, help="autoscaling: most replicas"
    )
    ray_args.add_argument(
        "--ray-address", default=None, help="a running Ray cluster (default: start one here)"
    )
    srv.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    srv.add_argument(
        "--kv-cache-memory",
        type=_memory_size,
        default=None,
        help="KV cache budget, e.g. 2GiB (default: 1/4 of free memory)",
    )
    srv.add_argument("--max-num-seqs", type=_positive_int, default=64, help="requests in the running batch")
    srv.add_argument("--max-batch-tokens", type=_positive_int, default=512, help="tokens per target forward")
    srv.add_argument(
        "--no-policy", dest="policy", action="store_false", help="never shorten drafts as the batch grows"
    )
    srv.set_defaults(func=cmd_serve)

    train = sub.add_parser("train", help="train drafter heads on a target model's hidden states")
    tsub = train.add_subparsers(dest="train_command", required=True)
    from specdecode.train import pipeline

    for method, about in TRAIN_METHODS.items():
        sub_parser = tsub.add_parser(method, help=about)
        pipeline.add_args(sub_parser, importlib.import_module(f"specdecode.train.{method}").TrainSettings)
        sub_parser.set_defaults(func=_train_of(method))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
