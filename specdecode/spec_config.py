"""Typed speculative-decoding settings, validated in one place.

Users pass a dictionary (`{"method": "prompt_lookup", ...}`) to the API, a JSON string to the
server, or flags to the CLI; `parse_speculative` turns each into one of the frozen dataclasses
below, or raises a `SpecDecodeError` that names the offending setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from specdecode.errors import SpecDecodeError

# A draft model's weights: as the target's (auto), floats, or quantized on load into one of
# `gguf.QUANTIZATIONS` (the test suite holds the two lists equal).
DRAFT_DTYPES = ("auto", "stored", "float32", "bfloat16", "float16", "q4_0", "q4_1", "q5_0", "q8_0")
DEFAULT_LOOKUP_TOKENS = 6  # the trained drafters' lookup branch (LookupBranchOptions)
DEFAULT_EAGLE2 = (3, 3, 8)  # depth, top_k, total_tokens (Eagle2Config)


def _draft_dtype(method: str, value: Any) -> None:
    if value not in DRAFT_DTYPES:
        choices = ", ".join(DRAFT_DTYPES)
        raise SpecDecodeError(f"{method}: draft_dtype must be one of {choices}, got {value!r}")


def _draft_window(method: str, value: Any) -> None:
    if value is not None:  # null: the whole prompt
        _positive(method, "draft_window", value)


def _draft_vocab_size(method: str, value: Any) -> None:
    if value in ("auto", "all"):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecDecodeError(
            f'{method}: draft_vocab_size must be "auto", "all" or a positive integer, got {value!r}'
        )


def _positive(method: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecDecodeError(f"{method}: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class DraftModelConfig:
    """A smaller model with the target's vocabulary drafts `num_draft_tokens` tokens a step.

    `use_draft_logits`: verify by rejection sampling with the draft's distribution (on) or by
    matching the draft's tokens as point masses (off). Greedy decoding is token matching either way.
    `draft_dtype`: the draft's weights. "auto": a GGUF draft, where the target's kernels run stored
    weights, runs through the same kernels, re-quantized to Q4_0 if it stores more than 5.5 bits a
    weight (a draft needs no exactness, the verifier decides; the Qwen 0.5B's 6.3 bits a weight
    read 0.39 GB a token, its Q4_0 copy 0.28 GB), else as stored ("stored" asks for that always);
    any other draft is bfloat16 for a float32 target on a CPU with the bf16 kernel, else the
    target's dtype. "q4_0", "q4_1", "q5_0", "q8_0": the draft's weights (a GGUF's dequantized)
    quantized on load into that block format, float32 activations, on a CPU. A draft whose
    weights are in block formats reads its prompt with int8 activations, and its decoding rows too
    where they are Q4_0, Q4_1, Q4_K or Q6_K on AVX-512 or AVX2 (`Kernels.int8_activations`).
    `draft_window`: the draft reads only the last N tokens of each prompt (None: all of it): it
    prefills every prompt as the target does, and on a CPU a long prompt's prefill can cost the
    draft more than its drafts save. Output is unchanged.
    `draft_vocab_size`: the draft proposes only token ids below N, reading N columns of its LM
    head a token instead of all ("all": its whole vocabulary; "auto": 32768 where the draft's
    vocabulary is over 65536, else all). A byte-pair vocabulary numbers its tokens in the order
    their merges were learnt, so the first ids are the common ones (Qwen2.5's first 32768 of
    151936 ids cover ~94% of the tokens of Python source). Output is unchanged.
    """

    method: ClassVar[str] = "draft_model"
    draft_model: str
    num_draft_tokens: int = 4
    use_draft_logits: bool = True
    draft_dtype: str = "auto"
    draft_window: int | None = None
    draft_vocab_size: int | str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.draft_model, str) or not self.draft_model:
            raise SpecDecodeError("draft_model: draft_model must name a model (short name or path)")
        _positive(self.method, "num_draft_tokens", self.num_draft_tokens)
        _draft_dtype(self.method, self.draft_dtype)
        _draft_window(self.method, self.draft_window)
        _draft_vocab_size(self.method, self.draft_vocab_size)
        if not isinstance(self.use_draft_logits, bool):
            raise SpecDecodeError(
                f"draft_model: use_draft_logits must be true or false, got {self.use_draft_logits!r}"
            )


@dataclass(frozen=True)
class PromptLookupConfig:
    """Draft by copying what followed the most recent earlier occurrence of the last n-gram.

    With `draft_model` set, the draft model drafts whenever lookup finds no match.
    `num_candidates` > 1 verifies the continuations of several earlier occurrences at once (a
    tree; our extension of the method, same output, more tokens accepted per step).
    """

    method: ClassVar[str] = "prompt_lookup"
    prompt_lookup_num_tokens: int = 4
    max_matching_ngram_size: int = 2
    num_candidates: int = 1
    draft_model: str | None = None
    num_draft_tokens: int = 4
    use_draft_logits: bool = True
    draft_dtype: str = "auto"
    draft_window: int | None = None
    draft_vocab_size: int | str = "auto"

    def __post_init__(self) -> None:
        _draft_dtype(self.method, self.draft_dtype)
        _draft_window(self.method, self.draft_window)
        _draft_vocab_size(self.method, self.draft_vocab_size)
        _positive(self.method, "prompt_lookup_num_tokens", self.prompt_lookup_num_tokens)
        _positive(self.method, "max_matching_ngram_size", self.max_matching_ngram_size)
        _positive(self.method, "num_candidates", self.num_candidates)
        _positive(self.method, "num_draft_tokens", self.num_draft_tokens)
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise SpecDecodeError("prompt_lookup: draft_model must name a model (short name or path)")


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding with window size W, n-gram size N and verification set size G.

    (1, 1, 0) means plain decoding. `max_draft_len` is the number of draft slots the engine
    reserves per step for this configuration, as TensorRT-LLM defines it.
    """

    method: ClassVar[str] = "lookahead"
    # Defaults picked on the forward-latency curve of SmolLM2 on a 2-core CPU, where a forward
    # over 6-8 tokens costs ~1.15-1.4x one token and over 17 (the (4, 3, 4) window) ~2x: the small
    # window drafts less but pays. Spec-Bench, 2 questions a category (session 3): (2, 3, 2) 1.16x
    # plain at tau 1.56, (2, 3, 1) 1.17x, (3, 2, 3) 1.17x, (3, 3, 3) 1.10x, (4, 3, 4) 1.00x at 1.68.
    window_size: int = 2
    ngram_size: int = 3
    verification_set_size: int = 2

    def __post_init__(self) -> None:
        w, n, g = self.window_size, self.ngram_size, self.verification_set_size
        _positive(self.method, "window_size", w)
        _positive(self.method, "ngram_size", n)
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise SpecDecodeError(f"lookahead: verification_set_size must be an integer >= 0, got {g!r}")
        if n == 1 and (w, g) != (1, 0):
            raise SpecDecodeError("lookahead: ngram_size 1 is only valid as (1, 1, 0), plain decoding")

    @property
    def is_plain(self) -> bool:
        return (self.window_size, self.ngram_size, self.verification_set_size) == (1, 1, 0)

    @property
    def max_draft_len(self) -> int:
        w, n, g = self.window_size, self.ngram_size, self.verification_set_size
        return (0 if n == 1 else n - 2) + (w - 1 + g) * (n - 1)

    def check_within(self, engine: LookaheadConfig) -> None:
        """A request's (w, n, g) must fit the engine's (W, N, G)."""
        mine = (self.window_size, self.ngram_size, self.verification_set_size)
        limit = (engine.window_size, engine.ngram_size, engine.verification_set_size)
        if self.is_plain:
            return
        if any(a > b for a, b in zip(mine, limit, strict=True)):
            raise SpecDecodeError(
                f"lookahead: request (W, N, G) = {mine} exceeds the engine's configured {limit}"
            )


@dataclass(frozen=True)
class LookupBranchOptions:
    """What the trained drafters (Medusa, ReDrafter, EAGLE-1, EAGLE-2) share: a prompt-lookup
    path grafted onto their tree (`specdecode/drafters/lookup_branch.py`). Up to
    `prompt_lookup_num_tokens` tokens (0: off) that followed the last earlier occurrence of the
    longest suffix n-gram of at most `max_matching_ngram_size` tokens; nodes the tree already has
    are reused. Output is unchanged; it adds what the heads are worst at, copying.
    """

    method: ClassVar[str]
    prompt_lookup_num_tokens: int = DEFAULT_LOOKUP_TOKENS
    max_matching_ngram_size: int = 2

    def _check_lookup(self) -> None:
        n = self.prompt_lookup_num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise SpecDecodeError(
                f"{self.method}: prompt_lookup_num_tokens must be an integer >= 0 "
                f"(0: no lookup branch), got {n!r}"
            )
        _positive(self.method, "max_matching_ngram_size", self.max_matching_ngram_size)


@dataclass(frozen=True)
class MedusaConfig(LookupBranchOptions):
    """Medusa heads on the target's last hidden state draft a tree of their top-k guesses.

    `heads`: a heads directory (specdecode's layout or the Medusa reference's); None = the heads
    shipped for the target model. `medusa_choices`: the tree as paths of top-k ranks, in either
    the all-candidates or the leaf-paths-only form (`[[0], [0, 0], [1]]`: the heads' best and
    second-best guesses for the next token, and the best for the one after the best); None = the
    tree fitted to the heads at training time, else a default for their number of heads.

    `typical_acceptance`: verify sampled requests with Medusa's typical acceptance instead of
    exact speculative sampling. This is LOSSY: the output no longer follows the target
    distribution (it accepts every plausible draft token). Greedy decoding is unaffected.
    `posterior_threshold` (epsilon, default 0.09) and `posterior_alpha` (delta, default 0.3)
    set its acceptance bar min(epsilon, delta * exp(-entropy)); they require typical_acceptance.
    """

    method: ClassVar[str] = "medusa"
    heads: str | None = None
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    typical_acceptance: bool = False
    posterior_threshold: float | None = None
    posterior_alpha: float | None = None

    def __post_init__(self) -> None:
        self._check_lookup()
        if self.heads is not None and (not isinstance(self.heads, str) or not self.heads):
            raise SpecDecodeError("medusa: heads must be a path to a heads directory")
        if self.medusa_choices is not None:
            choices = _tree_choices("medusa", "medusa_choices", self.medusa_choices)
            object.__setattr__(self, "medusa_choices", choices)
        if not isinstance(self.typical_acceptance, bool):
            raise SpecDecodeError(
                f"medusa: typical_acceptance must be true or false, got {self.typical_acceptance!r}"
            )
        for name, low, high in (("posterior_threshold", 0.0, 1.0), ("posterior_alpha", 0.0, 1.0)):
            value = getattr(self, name)
            if value is None:
                continue
            if not self.typical_acceptance:
                raise SpecDecodeError(f"medusa: {name} only applies with typical_acceptance true")
            if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
                raise SpecDecodeError(
                    f"medusa: {name} must be a number in ({low:g}, {high:g}], got {value!r}"
                )

    @property
    def typical(self) -> tuple[float, float] | None:
        """(posterior_threshold, posterior_alpha) when typical acceptance is on, else None."""
        if not self.typical_acceptance:
            return None
        threshold = 0.09 if self.posterior_threshold is None else float(self.posterior_threshold)
        alpha = 0.3 if self.posterior_alpha is None else float(self.posterior_alpha)
        return threshold, alpha


@dataclass(frozen=True)
class ReDrafterConfig(LookupBranchOptions):
    """A recurrent drafter on the target's last hidden state drafts the merged beams of a beam
    search (Cheng et al. 2024, "Recurrent Drafter").

    `head`: a drafter directory (specdecode's layout or apple/ml-recurrent-drafter's); None = the
    drafter shipped for the target model. `beam_width` beams of `beam_length` tokens, the root
    (the last decided token) counted as in the reference implementation: each beam drafts
    `beam_length - 1` tokens and the tree has at most `beam_width * (beam_length - 1)` nodes
    (fewer where beams share prefixes). The defaults (2, 4: at most 6 nodes) were the fastest
    of (2, 4), (4, 5) and (8, 5) for the shipped SmolLM2-135M drafter on Spec-Bench on a CPU
    (specdecode/heads/README.md): wider beams accept more but their beam steps cost more.
    """

    method: ClassVar[str] = "redrafter"
    head: str | None = None
    beam_width: int = 2
    beam_length: int = 4

    def __post_init__(self) -> None:
        self._check_lookup()
        if self.head is not None and (not isinstance(self.head, str) or not self.head):
            raise SpecDecodeError("redrafter: head must be a path to a drafter directory")
        _positive(self.method, "beam_width", self.beam_width)
        _positive(self.method, "beam_length", self.beam_length)
        if self.beam_length < 2:
            raise SpecDecodeError(
                f"redrafter: beam_length must be >= 2 (it counts the root: 2 drafts one token), "
                f"got {self.beam_length}"
            )


@dataclass(frozen=True)
class EagleConfig(LookupBranchOptions):
    """EAGLE-1: a one-layer head extrapolating the target's features drafts a static tree.

    `head`: an EAGLE head directory (specdecode's layout or the EAGLE reference's); None = the
    head shipped for the target model. `eagle_choices`: the tree as paths of top-k ranks, in the
    medusa_choices format (all candidates or leaf paths only); None = the tree fitted to the
    head at training time, else a default.
    """

    method: ClassVar[str] = "eagle"
    head: str | None = None
    eagle_choices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        self._check_lookup()
        _head_path(self.method, self.head)
        if self.eagle_choices is not None:
            choices = _tree_choices("eagle", "eagle_choices", self.eagle_choices)
            object.__setattr__(self, "eagle_choices", choices)


@dataclass(frozen=True)
class Eagle2Config(LookupBranchOptions):
    """EAGLE-2: the EAGLE head grows a dynamic tree by draft confidence.

    `depth` levels; at each, the `top_k` nodes of highest cumulative draft probability are
    expanded into `top_k` candidates each; then the `total_tokens` nodes of highest cumulative
    probability are verified. The defaults (3, 3, 8), with the lookup branch, were measured on
    Spec-Bench for SmolLM2-135M on a CPU: 1.30x plain decoding at tau 2.69, against 1.21x (2.76)
    for (4, 4, 11) and 1.40x (2.52) for (2, 3, 5), which hardly grows a tree; on a GPU larger
    trees cost little more.
    """

    method: ClassVar[str] = "eagle2"
    head: str | None = None
    depth: int = DEFAULT_EAGLE2[0]
    top_k: int = DEFAULT_EAGLE2[1]
    total_tokens: int = DEFAULT_EAGLE2[2]

    def __post_init__(self) -> None:
        self._check_lookup()
        _head_path(self.method, self.head)
        _positive(self.method, "depth", self.depth)
        _positive(self.method, "top_k", self.top_k)
        _positive(self.method, "total_tokens", self.total_tokens)


def _tree_choices(method: str, key: str, choices: object) -> tuple[tuple[int, ...], ...]:
    """A static tree's paths of top-k ranks, checked (`from_choices`) and stored as tuples, so the
    settings object stays immutable and hashable."""
    if not isinstance(choices, list | tuple) or not all(isinstance(c, list | tuple) for c in choices):
        raise SpecDecodeError(f"{method}: {key} must be a list of lists of top-k ranks, got {choices!r}")
    from specdecode.tree import from_choices

    from_choices(choices)  # empty paths, negative or non-integer ranks
    return tuple(tuple(c) for c in choices)


def _head_path(method: str, head: object) -> None:
    if head is not None and (not isinstance(head, str) or not head):
        raise SpecDecodeError(f"{method}: head must be a path to a head directory")


SpecConfig = (
    DraftModelConfig
    | PromptLookupConfig
    | LookaheadConfig
    | MedusaConfig
    | ReDrafterConfig
    | EagleConfig
    | Eagle2Config
)
METHODS: dict[str, type[SpecConfig]] = {
    cls.method: cls
    for cls in (
        DraftModelConfig,
        PromptLookupConfig,
        LookaheadConfig,
        MedusaConfig,
        ReDrafterConfig,
        EagleConfig,
        Eagle2Config,
    )
}
ALIASES = {"max_draft_len": "num_draft_tokens"}


def parse_speculative(spec: SpecConfig | dict[str, Any] | None) -> SpecConfig | None:
    """A validated config from a user's dictionary; None (or method "none") means plain decoding."""
    if spec is None or isinstance(spec, tuple(METHODS.values())):
        return spec  # type: ignore[return-value]
    if not isinstance(spec, dict):
        raise SpecDecodeError(f"speculative settings must be a dictionary, got {type(spec).__name__}")
    options = dict(spec)
    method = options.pop("method", None)
    if method in (None, "none", "off"):
        if options:
            raise SpecDecodeError("speculative: options given without a method")
        return None
    if method not in METHODS:
        raise SpecDecodeError(f"unknown speculative method {method!r}: choose one of {', '.join(METHODS)}")
    cls = METHODS[method]
    for alias, name in ALIASES.items():
        if alias in options:
            if name in options:
                raise SpecDecodeError(f"{method}: give {name} or its alias {alias}, not both")
            options[name] = options.pop(alias)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise SpecDecodeError(
            f"{method}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(valid: {', '.join(sorted(known))})"
        )
    try:
        return cls(**options)
    except TypeError as exc:  # a required option is missing
        raise SpecDecodeError(f"{method}: {exc}") from None
