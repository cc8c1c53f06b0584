"""Drafters built below the API: a registry from method name to builder, and one cached loader.

The engine asks `DrafterFactory.build(spec)` for a fresh drafter per request (drafters keep
per-request state). What drafters share across requests (a draft model's weights, trained heads)
is loaded once, checked against the target, and kept by `load`:

    factory = DrafterFactory(target, tokenizer, model_name="smollm2-135m")
    drafter = factory.build(parse_speculative({"method": "eagle2"}))   # a fresh EagleDrafter

A method is added by writing its drafter module and registering one builder here (`@builder`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdecode.drafters import eagle, medusa, redrafter
from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import (
    DraftCacheFactory,
    DraftModelDrafter,
    check_vocabularies,
    static_cache,
)
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.drafters.lookup_branch import LookupBranch
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.errors import SpecDecodeError
from specdecode.layers import bind_kernels, dense_linears, quantize_dense
from specdecode.layers.lm_head import DRAFT_FORMAT
from specdecode.models.config import ModelConfig
from specdecode.models.gguf import QUANTIZATIONS, bits_per_weight, source_gguf
from specdecode.models.loader import load_quantized, load_target, resolve_dtype, resolve_model
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.transformer import Transformer
from specdecode.spec_config import (
    DraftModelConfig,
    Eagle2Config,
    EagleConfig,
    LookaheadConfig,
    LookupBranchOptions,
    MedusaConfig,
    PromptLookupConfig,
    ReDrafterConfig,
    SpecConfig,
)

# (factory, the method's settings, the draft model's KV cache maker) -> a drafter, or None when
# the settings mean plain decoding (lookahead with W = 0).
Builder = Callable[["DrafterFactory", Any, DraftCacheFactory], Drafter | None]
BUILDERS: dict[str, Builder] = {}


def builder(*methods: str) -> Callable[[Builder], Builder]:
    """Register a builder for `methods` (their `SpecConfig.method` names)."""

    def register(fn: Builder) -> Builder:
        for method in methods:
            BUILDERS[method] = fn
        return fn

    return register


# Trained heads: where the shipped ones are, how to load and check them, what to call them in errors.
HEAD_KINDS: dict[str, tuple[Callable[[str], Path], Callable[..., Any], Callable[..., None], str]] = {
    "medusa": (medusa.shipped_heads, medusa.load_heads, medusa.check_fits, "Medusa heads"),
    "redrafter": (redrafter.shipped_head, redrafter.load_head, redrafter.check_fits, "ReDrafter"),
    "eagle": (eagle.shipped_head, eagle.load_head, eagle.check_fits, "the EAGLE head"),
}


# A GGUF draft model storing more bits a weight than this runs re-quantized to AUTO_DRAFT_FORMAT
# (`DraftModelConfig.draft_dtype` "auto"): a draft needs no exactness, and on a CPU a draft token
# costs the bytes it reads.
AUTO_DRAFT_BITS = 5.5
AUTO_DRAFT_FORMAT = "q4_0"


# `DraftModelConfig.draft_vocab_size` "auto": a draft whose vocabulary is larger than
# AUTO_DRAFT_VOCAB_OVER proposes from its first AUTO_DRAFT_VOCAB ids. Qwen2.5-Coder-0.5B (151936
# ids) drafting for the 1.5B on the MT-Bench coding questions, three runs, decoding alone: 1.34x /
# 1.39x / 1.40x plain with all, 1.44x / 1.41x / 1.40x with 32768 (its head took 1.16 ms of a 5.4 ms
# draft token, 0.25 ms over 32768 columns, but 6% of tokens are out of its reach); 16384 lost tau
# (3.14 -> 2.74, 1.33x).
AUTO_DRAFT_VOCAB = 32768
AUTO_DRAFT_VOCAB_OVER = 65536


def draft_vocab(setting: int | str, vocab_size: int) -> int | None:
    """The ids a draft model proposes from, as its first N (`draft_vocab_size`), or None for all
    of its `vocab_size`."""
    if setting == "auto":
        setting = AUTO_DRAFT_VOCAB if vocab_size > AUTO_DRAFT_VOCAB_OVER else "all"
    if setting == "all" or int(setting) >= vocab_size:
        return None
    return int(setting)


class DrafterFactory:
    """Builds drafters for requests on `target`; loads draft models and heads once each.

    `model_name` is the name the target was loaded by (it finds the heads shipped for it);
    `tokenizer` checks that a draft model shares the target's vocabulary."""

    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer | None = None,
        model_name: str | None = None,
        progress: bool = True,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.progress = progress
        self._loaded: dict[tuple[str, str, torch.dtype | str], Any] = {}

    def build(self, spec: SpecConfig | None, draft_cache: DraftCacheFactory | None = None) -> Drafter | None:
        """A fresh drafter for one request (None: plain decoding). `draft_cache` makes a draft
        model's KV cache (None: a static one; the engine passes paged ones)."""
        if spec is None:
            return None
        drafter = BUILDERS[spec.method](self, spec, draft_cache or static_cache)
        if isinstance(spec, LookupBranchOptions) and spec.prompt_lookup_num_tokens > 0:
            assert drafter is not None
            return LookupBranch(drafter, spec.prompt_lookup_num_tokens, spec.max_matching_ngram_size)
        return drafter

    def load(self, kind: str, where: str, dtype: torch.dtype | str, make: Callable[[], Any]) -> Any:
        """The one cache of what drafters load: `make()` runs once per (kind, where, dtype)."""
        key = (kind, where, dtype)
        if key not in self._loaded:
            self._loaded[key] = make()
        return self._loaded[key]

    def draft_model(self, name: str, dtype: str = "auto") -> Transformer:
        """The draft model `name` in `dtype` (see `DraftModelConfig.draft_dtype`), loaded once and
        checked to share the target's vocabulary."""
        path = resolve_model(name, progress=self.progress)
        # "auto": a GGUF draft for a target that runs its weights as stored runs its own through
        # the same kernels, in Q4_0 where it stores more bits a weight (the 0.5B Qwen draft's
        # Q5_0/Q8_0 matrices: 0.28 GB a token instead of 0.39 GB, 6.9 ms a forward instead of
        # 11.3 on the session-16 machine), else as stored.
        stored_here = self.target.kernels.quant is not None
        source = source_gguf(path) if stored_here else None
        if dtype == "auto" and source is not None:
            # Read once per file, through the one cache: a GGUF's tables take seconds (its vocabulary).
            bits = self.load("bits_per_weight", str(source), "", lambda: bits_per_weight(source))
            if bits > AUTO_DRAFT_BITS:
                dtype = AUTO_DRAFT_FORMAT
        if dtype == "stored" and source is None:
            raise SpecDecodeError(
                f"draft_dtype=stored: {name} is not a GGUF, or the kernels here run no stored weights"
            )
        as_stored = dtype in ("auto", "stored") and source is not None
        if as_stored:
            use: torch.dtype | str = "stored"
        elif dtype in QUANTIZATIONS:
            use = dtype
        elif dtype == "auto":
            use = self.target.dtype
            if use == torch.float32 and self.target.kernels.fast_bf16:
                use = torch.bfloat16
        else:
            use = resolve_dtype(dtype)

        def make() -> Transformer:
            if self.tokenizer is None:
                raise SpecDecodeError("a draft model needs the target's tokenizer to check its vocabulary")
            check_vocabularies(
                self.tokenizer,
                Tokenizer.from_dir(path),
                self.model_name or "the target",
                name,
                self.target.config.vocab_size,
                ModelConfig.from_dir(path).vocab_size,
            )
            if as_stored:
                model = load_target(path, "auto", self.target.device)
            elif isinstance(use, str):
                model = load_quantized(path, use, self.target.device)
            else:
                model = Transformer.from_dir(path, use, self.target.device)
            model.bind_kernels(model.kernels.int8_activations())  # int8 activations (a draft only proposes)
            return model

        return self.load("draft_model", name, use, make)

    def head(self, kind: str, path: str | None) -> Any:
        """Trained heads of `kind` ("medusa", "redrafter", "eagle") from `path` (None: those
        shipped for the target), loaded once and checked to fit the target."""
        shipped, load, check_fits, label = HEAD_KINDS[kind]
        if path is None:
            if self.model_name is None:
                raise SpecDecodeError(f"{label}: no path given and the target has no shipped heads")
            where = str(shipped(self.model_name))
        else:
            where = str(Path(path).expanduser().resolve())
        target = self.target

        def make() -> Any:
            heads = load(where, target.dtype, target.device)
            check_fits(heads, target, f"{label} {where}")
            dense_linears(heads)  # torch's Linear blocks (Medusa's, ReDrafter's) through the kernels too
            if target.runs_stored:  # a head's bytes are read once per draft depth: a byte a weight
                quantize_dense(heads, DRAFT_FORMAT)
            bind_kernels(heads, target.kernels)  # drafting runs a few rows at a time, as verifying
            if hasattr(heads, "draft_head"):
                # Built now, not in the first `propose`: 0.1 s there read to the load policy as
                # what every draft token costs (6 ms for SmolLM2's EAGLE), and it never drafted again.
                heads.draft_head(target)
            return heads

        return self.load(kind, where, target.dtype, make)


def _draft_drafter(
    f: DrafterFactory, spec: DraftModelConfig | PromptLookupConfig, cache: DraftCacheFactory
) -> DraftModelDrafter:
    assert spec.draft_model is not None
    draft = f.draft_model(spec.draft_model, spec.draft_dtype)
    n = draft_vocab(spec.draft_vocab_size, draft.config.vocab_size)
    head = None
    if n is not None:  # its first n columns, made once
        head = f.load(
            "draft_head",
            spec.draft_model,
            f"{spec.draft_dtype}:{n}",
            lambda: draft.approx_head(torch.arange(n)),
        )
    return DraftModelDrafter(spec, draft, f.target.config.vocab_size, cache, head)


@builder("draft_model")
def _draft_model(f: DrafterFactory, spec: DraftModelConfig, cache: DraftCacheFactory) -> Drafter:
    return _draft_drafter(f, spec, cache)


@builder("prompt_lookup")
def _prompt_lookup(f: DrafterFactory, spec: PromptLookupConfig, cache: DraftCacheFactory) -> Drafter:
    fallback = None if spec.draft_model is None else _draft_drafter(f, spec, cache)
    return PromptLookupDrafter(spec, fallback)


@builder("lookahead")
def _lookahead(f: DrafterFactory, spec: LookaheadConfig, cache: DraftCacheFactory) -> Drafter | None:
    return None if spec.is_plain else LookaheadDrafter(spec)


@builder("medusa")
def _medusa(f: DrafterFactory, spec: MedusaConfig, cache: DraftCacheFactory) -> Drafter:
    return medusa.MedusaDrafter(f.head("medusa", spec.heads), f.target, spec.medusa_choices, spec.typical)


@builder("redrafter")
def _redrafter(f: DrafterFactory, spec: ReDrafterConfig, cache: DraftCacheFactory) -> Drafter:
    head = f.head("redrafter", spec.head)
    return redrafter.ReDrafter(head, f.target, spec.beam_width, spec.beam_length)


@builder("eagle")
def _eagle(f: DrafterFactory, spec: EagleConfig, cache: DraftCacheFactory) -> Drafter:
    return eagle.EagleDrafter.static(f.head("eagle", spec.head), f.target, spec.eagle_choices)


@builder("eagle2")
def _eagle2(f: DrafterFactory, spec: Eagle2Config, cache: DraftCacheFactory) -> Drafter:
    head = f.head("eagle", spec.head)
    return eagle.EagleDrafter.dynamic(head, f.target, spec.depth, spec.top_k, spec.total_tokens)
