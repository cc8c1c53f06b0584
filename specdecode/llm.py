"""The Python API: `LLM(model=...)`, `generate`, `stream`, `chat`.

from specdecode import LLM, SamplingParams
llm = LLM(model="smollm2-135m", dtype="float32")
outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32, temperature=0.0))
print(outs[0].text, outs[0].token_ids)

`LLM` is a facade: it loads the model and tokenizer, then drives the one batched engine
(`engine.llm_engine.LLMEngine`). `generate` adds every prompt and steps until all finish, so many
prompts decode together (in-flight batching up to `max_num_seqs`); one prompt is a batch of one.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.engine.config import EngineConfig
from specdecode.engine.detokenizer import TextStream
from specdecode.engine.drafter_factory import DrafterFactory
from specdecode.engine.llm_engine import EngineRequest, LLMEngine, RequestDelta
from specdecode.engine.scheduler import Sequence as EngineSequence
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_target, resolve_device, resolve_model
from specdecode.models.tokenizer import Tokenizer
from specdecode.outputs import RequestOutput
from specdecode.sampling import SamplingParams
from specdecode.spec_config import SpecConfig, parse_speculative

Prompt = str | list[int]
Message = dict[str, str]
Speculative = SpecConfig | dict | None
DEFAULT = object()  # "use the LLM's own speculative setting"


@dataclass
class _Pending:
    """One prompt of a call, while the engine runs it."""

    prompt: Prompt
    seq: EngineSequence
    text: TextStream
    deltas: list[RequestDelta] = field(default_factory=list)  # arrived, not yet read
    done: bool = False


class LLM:
    """A target model ready to generate: weights, tokenizer and the engine that runs them.

    `model` is a short name (`specdecode models list`), a `.gguf` file, a Hugging Face model
    directory, or a hub id where a network exists. `dtype` "auto" runs a GGUF's weights as stored
    (its block formats, float32 activations; on a CPU) and other models in float32, and on a GPU
    every model in bfloat16; "float32", "bfloat16" or "float16" dequantize every weight to that
    dtype. `quantization` ("q4_0", "q4_1", "q5_0", "q8_0") quantizes a float checkpoint's linear
    weights and LM head on load, run as a GGUF's are. `activations` "int8" rounds the inputs of
    those block-format products to int8 per group of 32 where that is faster, as llama.cpp does
    (faster prompts, and decoding of Q4_0, Q4_1, Q4_K, Q6_K and Q8_0; its own speculative and plain decoding
    still agree token for token); "float32", the default, keeps the results those of the
    dequantized weights. `device` defaults to CUDA when available, else CPU. `speculative` is the
    default speculative method for every call (a dictionary such as `{"method":
    "prompt_lookup"}`; None = plain decoding);
    a lookahead setting here also fixes the largest (W, N, G) a call may ask for.

    The engine's settings, as vLLM names them: `max_num_seqs` requests decode together,
    `max_num_batched_tokens` rows per target forward, `kv_cache_memory` bytes of KV blocks (None:
    a share of the memory available), `enable_prefix_caching` reuses the KV blocks of shared
    prompt prefixes, `kv_cache_dtype` ("auto": the model's dtype; "float16" on a CPU: half the
    bytes, keys and values rounded once as they are stored) is what the cache keeps them in.
    `speculation_policy` (on, as in the server) lets the load policy choose each step how many
    draft tokens each request verifies, from this machine's measured cost of a
    forward and the acceptance seen so far: short drafts where the weights are cheap to read but
    rows cost their arithmetic (quantized weights on a CPU), none for a wide batch unless they pay.
    Greedy outputs are the same either way; a seeded sampled request always drafts its method's
    whole proposal, so its text stays reproducible. Off: every request drafts what its method
    proposes.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        speculative: Speculative = None,
        num_threads: int | None = None,
        progress: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        speculation_policy: bool = True,
        quantization: str | None = None,
        activations: str = "float32",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_threads is not None:
            if num_threads < 1:
                raise SpecDecodeError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        self.model_name = model
        self.speculative = parse_speculative(speculative)
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory,
            prefix_caching=enable_prefix_caching,
            policy=speculation_policy,
            speculative=self.speculative,
            kv_cache_dtype=kv_cache_dtype,
        )
        with collector_paused():
            path = resolve_model(model, progress=progress)
            self.tokenizer = Tokenizer.from_dir(path)
            self.model = load_target(path, dtype, resolve_device(device), quantization, activations)
            self.drafters = DrafterFactory(self.model, self.tokenizer, model, progress)
            if self.speculative is not None:
                self.drafters.build(self.speculative)  # load a draft model or heads now: fail early
            self.engine = self.new_engine(config)
        self._ids = itertools.count()
        self._pending: dict[str, _Pending] = {}

    def new_engine(self, config: EngineConfig) -> LLMEngine:
        """Another engine over this LLM's weights and drafters, with its own settings and KV
        cache (the server's, a benchmark's)."""
        return LLMEngine(self.model, config, self.drafters, self.tokenizer.eos_token_ids)

    # ---- prompts -------------------------------------------------------------------------------

    def _spec(self, speculative: Speculative | object) -> SpecConfig | None:
        if speculative is DEFAULT:
            return self.speculative
        return parse_speculative(speculative)  # type: ignore[arg-type]

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise SpecDecodeError("a prompt must be a string or a list of token ids")

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the reply."""
        if not messages:
            raise SpecDecodeError("messages must not be empty")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert isinstance(ids, list)
        return ids

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: Speculative | Sequence[Speculative] | object = DEFAULT,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids used as given); the outputs
        come in the prompts' order. All prompts run together on the engine.

        `params` and `speculative` are one value for every prompt or a list with one per prompt;
        `speculative` overrides the LLM's default method (None = plain decoding)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        each_params = _per_prompt("params", params or SamplingParams(), SamplingParams, len(prompts))
        each_spec = _per_prompt("speculative", speculative, (SpecConfig, dict, type(None)), len(prompts))
        # Everything is checked before anything runs: a bad prompt adds none of the others.
        todo = [
            (p, self._prompt_ids(p), sp, self._spec(s))
            for p, sp, s in zip(prompts, each_params, each_spec, strict=True)
        ]
        pending = self._add(todo)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="generate", unit="prompt")
        try:
            left = set(range(len(pending)))
            while left:
                self._step()
                for i in list(left):
                    item = pending[i]
                    for delta in self._take(item):
                        self._check_stop(item, delta)
                    if item.done:
                        left.discard(i)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self._forget(pending)
        return [self._output(item) for item in pending]

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        speculative: Speculative | object = DEFAULT,
    ) -> Iterator[str]:
        """Yield the text of one generation piece by piece as it is produced."""
        params = params or SamplingParams()
        (item,) = self._add([(prompt, self._prompt_ids(prompt), params, self._spec(speculative))])
        try:
            while not item.done:
                self._step()
                for delta in self._take(item):
                    self._check_stop(item, delta)
                    text = item.text.update(item.seq.req.output_ids, final=item.done)
                    if text:
                        yield text
        finally:
            self._forget([item])

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: Speculative | Sequence[Speculative] | object = DEFAULT,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, speculative, use_tqdm)

    # ---- driving the engine --------------------------------------------------------------------

    def _add(self, todo: list[tuple[Prompt, list[int], SamplingParams, SpecConfig | None]]) -> list[_Pending]:
        """Add each (prompt, ids, params, spec) to the engine; on a refusal, none stays added."""
        added: list[_Pending] = []
        try:
            for prompt, ids, params, spec in todo:
                rid = f"llm-{next(self._ids)}"
                seq = self.engine.add_request(EngineRequest(rid, ids, params, spec))
                item = _Pending(prompt, seq, TextStream(self.tokenizer, params.stop))
                self._pending[rid] = item
                added.append(item)
        except BaseException:
            self._forget(added)
            raise
        return added

    def _step(self) -> None:
        """One engine step; each delta goes to the call that waits for its request (several
        calls may be open at once, e.g. two streams read in turn)."""
        for delta in self.engine.step():
            item = self._pending.get(delta.request_id)
            if item is not None:
                item.deltas.append(delta)

    @staticmethod
    def _take(item: _Pending) -> list[RequestDelta]:
        deltas, item.deltas = item.deltas, []
        return deltas

    def _check_stop(self, item: _Pending, delta: RequestDelta) -> None:
        """Mark `item` done when the engine finished it or its text met a stop string (then the
        engine drops it before its next step, as a finished request)."""
        if delta.finished:
            item.done = True
        elif item.text.stop:
            item.text.update(item.seq.req.output_ids, final=False)
            if item.text.stopped:
                item.seq.req.finish_reason = "stop"
                self.engine.abort(item.seq.request_id, finished=True)
                item.done = True

    def _forget(self, items: list[_Pending]) -> None:
        """Drop the calls' requests from the engine (those still running: an error, or a stream
        its reader left) and from the routing table."""
        for item in items:
            self._pending.pop(item.seq.request_id, None)
            if not item.done:
                self.engine.abort(item.seq.request_id)

    def _output(self, item: _Pending) -> RequestOutput:
        req = item.seq.req
        item.text.update(req.output_ids, final=True)
        return RequestOutput(
            prompt=item.prompt if isinstance(item.prompt, str) else None,
            prompt_token_ids=req.prompt_ids,
            text=item.text.text,
            token_ids=req.output_ids,
            finish_reason=req.finish_reason or "length",
            stats=req.stats,
            timing=req.timing,
            logprobs=req.logprobs,
        )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a model loads, as it was after. Loading makes
    ~300k long-lived objects (SmolLM2's tokenizer, the model's modules), and the collections that
    their allocations set off scanned them again and again: a quarter of `LLM(...)`'s time
    (SmolLM2 on a 2-core Xeon: 4.1-4.3 s, 3.1 s with the collector paused). Nothing of the load
    is lost to it: what loading leaves unreachable in cycles is collected later.

    After a load that succeeds (with the collector on), one full collection: it takes the load's
    objects to the oldest generation at once. Left to the collector, they were scanned twice more
    during the first requests, by the first young collection and the tenth (SmolLM2: ~50 ms each,
    1.4% of six Spec-Bench turns); after it, ~3 ms of collections in the same turns."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    if enabled:
        gc.collect()


def _per_prompt(name: str, value: object, kind: type | tuple[type, ...], n: int) -> list:
    """`value` for each of `n` prompts: a single value repeated, or a list of exactly `n`."""
    if isinstance(value, list | tuple) and not isinstance(value, kind):
        if len(value) != n:
            raise SpecDecodeError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
