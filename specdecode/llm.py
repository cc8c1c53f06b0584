"""The Python API: `LLM(model=...)`, `generate`, `stream`, `chat`.

from specdecode import LLM, SamplingParams
llm = LLM(model="smollm2-135m", dtype="float32")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
print(outs[0].text, outs[0].token_ids)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import Drafter
from specdecode.engine import Engine, Request
from specdecode.errors import SpecDecodeError
from specdecode.models import cpu_gemm
from specdecode.models.config import ModelConfig
from specdecode.models.loader import resolve_model
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.transformer import Transformer
from specdecode.outputs import RequestOutput
from specdecode.sampling import SamplingParams
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
    parse_speculative,
)

if TYPE_CHECKING:
    from specdecode.drafters.draft_model import DraftCacheFactory
    from specdecode.drafters.eagle import EagleHead
    from specdecode.drafters.medusa import MedusaHeads
    from specdecode.drafters.redrafter import ReDrafterHead

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

Prompt = str | list[int]
Message = dict[str, str]
Speculative = SpecConfig | dict | None
DEFAULT = object()  # "use the LLM's own speculative setting"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise SpecDecodeError(f"unsupported dtype {dtype}: use float32 or bfloat16")
    try:
        return DTYPES[dtype]
    except KeyError:
        raise SpecDecodeError(f"unsupported dtype {dtype!r}: use float32 or bfloat16") from None


def resolve_device(device: str | None) -> torch.device:
    """`None`/"auto": CUDA when there is one, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SpecDecodeError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecodeError(f"device {device!r} requested but no CUDA GPU is available")
    return dev


class TextStream:
    """Turns a growing list of token ids into text deltas, ending the text before a stop string.

    Text is released only when it cannot change any more: a trailing incomplete UTF-8 sequence
    (decoded as U+FFFD) and any tail that could be the start of a stop string are held back.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the whole text so far, after any stop cut
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def update(self, token_ids: list[int], final: bool) -> str:
        """Decode all tokens so far; return the newly releasable text."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(token_ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                text, final, self.stopped = text[:at], True, True
        self.text = text
        if final:
            ready = len(text)
        else:
            ready = len(text) - self.hold
            if text.endswith("\ufffd"):
                ready = min(ready, len(text.rstrip("\ufffd")))
        if ready <= self.sent:
            return ""
        delta, self.sent = text[self.sent : ready], ready
        return delta


class LLM:
    """A target model ready to generate: weights, tokenizer and the decoding engine.

    `model` is a short name (`specdecode models list`), a `.gguf` file, a Hugging Face model
    directory, or a hub id where a network exists. `dtype` is float32 or bfloat16; `device`
    defaults to CUDA when available, else CPU. `speculative` is the default speculative method
    for every call (a dictionary such as `{"method": "prompt_lookup"}`; None = plain decoding);
    a lookahead setting here also fixes the largest (W, N, G) a call may ask for.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        speculative: Speculative = None,
        num_threads: int | None = None,
        progress: bool = True,
    ) -> None:
        if num_threads is not None:
            if num_threads < 1:
                raise SpecDecodeError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        self.model_name = model
        self.speculative = parse_speculative(speculative)
        self.lookahead_limit = self.speculative if isinstance(self.speculative, LookaheadConfig) else None
        self.progress = progress
        path = resolve_model(model, progress=progress)
        self.tokenizer = Tokenizer.from_dir(path)
        self.model = Transformer.from_dir(path, dtype=resolve_dtype(dtype), device=resolve_device(device))
        self.engine = Engine(self.model)
        self._draft_models: dict[tuple[str, torch.dtype], Transformer] = {}
        self._medusa_heads: dict[str, MedusaHeads] = {}
        self._redrafter_heads: dict[str, ReDrafterHead] = {}
        self._eagle_heads: dict[str, EagleHead] = {}
        if self.speculative is not None:
            self._drafter(self.speculative)  # load a draft model now and fail early on bad settings

    # ---- speculation ---------------------------------------------------------------------------

    def _spec(self, speculative: Speculative | object) -> SpecConfig | None:
        if speculative is DEFAULT:
            return self.speculative
        spec = parse_speculative(speculative)  # type: ignore[arg-type]
        if isinstance(spec, LookaheadConfig) and self.lookahead_limit is not None:
            spec.check_within(self.lookahead_limit)
        return spec

    def draft_model(self, name: str, dtype: str = "auto") -> Transformer:
        """The draft model `name` in `dtype` (see `DraftModelConfig.draft_dtype`), loaded once and
        checked to share the target's vocabulary."""
        if dtype == "auto":
            cpu_bf16 = self.model.device.type == "cpu" and cpu_gemm.kernel_bf16() is not None
            use = torch.bfloat16 if self.model.dtype == torch.float32 and cpu_bf16 else self.model.dtype
        else:
            use = resolve_dtype(dtype)
        key = (name, use)
        if key not in self._draft_models:
            from specdecode.drafters.draft_model import check_vocabularies

            path = resolve_model(name, progress=self.progress)
            check_vocabularies(
                self.tokenizer,
                Tokenizer.from_dir(path),
                self.model_name,
                name,
                self.model.config.vocab_size,
                ModelConfig.from_dir(path).vocab_size,
            )
            self._draft_models[key] = Transformer.from_dir(path, use, self.model.device)
        return self._draft_models[key]

    def medusa_heads(self, path: str | None) -> MedusaHeads:
        """Medusa heads from `path` (None: those shipped for this model), loaded once and checked
        to fit the target's hidden size and vocabulary."""
        from specdecode.drafters.medusa import check_fits, load_heads, shipped_heads

        where = str(shipped_heads(self.model_name) if path is None else Path(path).expanduser().resolve())
        if where not in self._medusa_heads:
            heads = load_heads(where, self.model.dtype, self.model.device)
            check_fits(heads, self.model, f"Medusa heads {where}")
            self._medusa_heads[where] = heads
        return self._medusa_heads[where]

    def redrafter_head(self, path: str | None) -> ReDrafterHead:
        """A ReDrafter from `path` (None: the one shipped for this model), loaded once and checked
        to fit the target's hidden size and vocabulary."""
        from specdecode.drafters.redrafter import check_fits, load_head, shipped_head

        where = str(shipped_head(self.model_name) if path is None else Path(path).expanduser().resolve())
        if where not in self._redrafter_heads:
            head = load_head(where, self.model.dtype, self.model.device)
            check_fits(head, self.model, f"ReDrafter {where}")
            self._redrafter_heads[where] = head
        return self._redrafter_heads[where]

    def eagle_head(self, path: str | None) -> EagleHead:
        """An EAGLE head from `path` (None: the one shipped for this model), loaded once and
        checked to fit the target's hidden size and vocabulary."""
        from specdecode.drafters.eagle import check_fits, load_head, shipped_head

        where = str(shipped_head(self.model_name) if path is None else Path(path).expanduser().resolve())
        if where not in self._eagle_heads:
            head = load_head(where, self.model.dtype, self.model.device)
            check_fits(head, self.model, f"the EAGLE head {where}")
            self._eagle_heads[where] = head
        return self._eagle_heads[where]

    def _drafter(
        self, spec: SpecConfig | None, draft_cache: DraftCacheFactory | None = None
    ) -> Drafter | None:
        """A fresh drafter for one request (drafters keep per-request state). `draft_cache` makes
        a draft model's KV cache (None: a static one; the serving engine passes paged ones)."""
        vocab = self.model.config.vocab_size
        if spec is None:
            return None
        if isinstance(spec, DraftModelConfig):
            from specdecode.drafters.draft_model import DraftModelDrafter, static_cache

            draft = self.draft_model(spec.draft_model, spec.draft_dtype)
            return DraftModelDrafter(spec, draft, vocab, draft_cache or static_cache)
        if isinstance(spec, PromptLookupConfig):
            from specdecode.drafters.draft_model import DraftModelDrafter, static_cache
            from specdecode.drafters.prompt_lookup import PromptLookupDrafter

            fallback = None
            if spec.draft_model is not None:
                draft = self.draft_model(spec.draft_model, spec.draft_dtype)
                fallback = DraftModelDrafter(spec, draft, vocab, draft_cache or static_cache)
            return PromptLookupDrafter(spec, fallback)
        if isinstance(spec, LookaheadConfig):
            from specdecode.drafters.lookahead import LookaheadDrafter

            return None if spec.is_plain else LookaheadDrafter(spec)
        trained = self._trained_drafter(spec)
        if spec.prompt_lookup_num_tokens == 0:
            return trained
        from specdecode.drafters.lookup_branch import LookupBranch

        return LookupBranch(trained, spec.prompt_lookup_num_tokens, spec.max_matching_ngram_size)

    def _trained_drafter(self, spec: LookupBranchOptions) -> Drafter:
        """The drafter of a method with trained heads (the lookup branch not yet added)."""
        if isinstance(spec, MedusaConfig):
            from specdecode.drafters.medusa import MedusaDrafter

            return MedusaDrafter(self.medusa_heads(spec.heads), self.model, spec.medusa_choices, spec.typical)
        if isinstance(spec, ReDrafterConfig):
            from specdecode.drafters.redrafter import ReDrafter

            return ReDrafter(self.redrafter_head(spec.head), self.model, spec.beam_width, spec.beam_length)
        if isinstance(spec, EagleConfig):
            from specdecode.drafters.eagle import EagleDrafter

            return EagleDrafter.static(self.eagle_head(spec.head), self.model, spec.eagle_choices)
        if isinstance(spec, Eagle2Config):
            from specdecode.drafters.eagle import EagleDrafter

            head = self.eagle_head(spec.head)
            return EagleDrafter.dynamic(head, self.model, spec.depth, spec.top_k, spec.total_tokens)
        raise AssertionError(f"no drafter for {spec!r}")

    # ---- prompts -------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise SpecDecodeError("a prompt must be a string or a list of token ids")

    def _request(self, prompt: Prompt, params: SamplingParams, spec: SpecConfig | None) -> Request:
        ids = self._prompt_ids(prompt)
        return Request(self.model, ids, params, self.tokenizer.eos_token_ids, self._drafter(spec))

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        speculative: Speculative | object = DEFAULT,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids used as given) in order.

        `speculative` overrides the LLM's default method for this call (None = plain decoding)."""
        params = params or SamplingParams()
        spec = self._spec(speculative)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        outputs: list[RequestOutput] = []
        if use_tqdm:
            from tqdm import tqdm

            prompts = tqdm(prompts, desc="generate", unit="prompt")
        for prompt in prompts:
            outputs.append(self._run(prompt, params, spec))
        return outputs

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        speculative: Speculative | object = DEFAULT,
    ) -> Iterator[str]:
        """Yield the text of one generation piece by piece as it is produced."""
        req = self._request(prompt, params or SamplingParams(), self._spec(speculative))
        stream = TextStream(self.tokenizer, req.params.stop)
        for _ in self.engine.generate(req):
            delta = stream.update(req.output_ids, final=req.finish_reason is not None)
            if stream.stopped:
                req.finish_reason = "stop"
            if delta:
                yield delta
            if stream.stopped:
                return

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | None = None,
        speculative: Speculative | object = DEFAULT,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, speculative)

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the reply."""
        if not messages:
            raise SpecDecodeError("messages must not be empty")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert isinstance(ids, list)
        return ids

    def _run(self, prompt: Prompt, params: SamplingParams, spec: SpecConfig | None) -> RequestOutput:
        req = self._request(prompt, params, spec)
        stream = TextStream(self.tokenizer, params.stop)
        for _ in self.engine.generate(req):
            if params.stop:
                stream.update(req.output_ids, final=False)
                if stream.stopped:  # ends the engine's loop before its next step
                    req.finish_reason = "stop"
        stream.update(req.output_ids, final=True)
        return RequestOutput(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=req.prompt_ids,
            text=stream.text,
            token_ids=req.output_ids,
            finish_reason=req.finish_reason or "length",
            stats=req.stats,
            timing=req.timing,
            logprobs=req.logprobs,
        )
