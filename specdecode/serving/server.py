"""OpenAI-compatible HTTP server over the serving engine (`specdecode serve`).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (server-sent events when
`stream` is true), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).

The application is written against `EngineClient`: `AsyncEngine` (one engine on a thread of this
process) or `distributed.serve.ReplicaClient` (engine replicas on Ray Serve, `--replicas`); and
needs of the model only its `Frontend` (tokenizer, context, vocabulary), so a Ray ingress does not
load weights.

Each choice of a request (`n` per prompt) is one engine request. Its tokens are detokenized
incrementally by `TextStream`, which also ends the text before a `stop` string; a choice that
meets its stop string, and every choice of a client that disconnects, is aborted in the engine
so its KV blocks are freed at once.

Extensions to the OpenAI request: `speculative` (the Python API's dictionary; null = plain
decoding; absent = the server's default), `top_k`, `ignore_eos`. Extensions to `usage`:
`num_draft_tokens`, `num_accepted_tokens`, `mean_accepted_length` (τ, tokens per target
forward), `cached_prompt_tokens` (prompt tokens served from reused KV blocks, also given as
`prompt_tokens_details.cached_tokens`), `time_to_first_token_s` (the engine's, from the arrival
of the request to its first token) and `decode_tokens_per_s` (one figure per choice).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any, Literal, NamedTuple, Protocol, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from specdecode.engine.config import EngineConfig
from specdecode.engine.detokenizer import TextStream
from specdecode.engine.llm_engine import EngineRequest, EngineStats, RequestDelta
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.models.config import ModelConfig
from specdecode.models.loader import resolve_model
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from specdecode.serving.async_engine import AsyncEngine, DeltaStream, EngineStopped
from specdecode.serving.metrics import render
from specdecode.spec_config import SpecConfig, parse_speculative

MAX_N = 128  # choices per prompt, as OpenAI allows
# Parameters OpenAI defines that this server does not implement, with the value that means "off":
# any other value is refused (naming the parameter), never silently ignored.
UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "echo": False,
    "suffix": "",
    "best_of": 1,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
}
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit (chat allows MAX_LOGPROBS)
LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity: a token of probability 0 reports this, as vLLM

# ---- what the application needs of a model and an engine ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Frontend:
    """What the HTTP layer needs of a model: its name, tokenizer, context and vocabulary size."""

    name: str
    tokenizer: Tokenizer
    context: int
    vocab_size: int

    @classmethod
    def of(cls, llm: LLM) -> Frontend:
        config = llm.model.config
        return cls(llm.model_name, llm.tokenizer, config.max_position_embeddings, config.vocab_size)

    @classmethod
    def load(cls, model: str, progress: bool = False) -> Frontend:
        """The tokenizer and config of `model` (a short name or a path), without its weights."""
        path = resolve_model(model, progress=progress)
        config = ModelConfig.from_dir(path)
        return cls(model, Tokenizer.from_dir(path), config.max_position_embeddings, config.vocab_size)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the reply."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert isinstance(ids, list)
        return ids


class EngineClient(Protocol):
    """The engine(s) the application submits to."""

    async def generate(self, req: EngineRequest) -> DeltaStream:
        """The request's stream once an engine accepted it; its error (a `SpecDecodeError` for
        bad input) otherwise."""
        ...

    @property
    def alive(self) -> bool: ...

    async def replica_stats(self) -> Mapping[str, EngineStats]:
        """Each engine's counters by replica name ("" for a lone engine: no replica label)."""
        ...


# ---- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ---- request bodies ----------------------------------------------------------------------------


NonEmptyStr = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class GenerationBody(BaseModel):
    """Fields shared by completions and chat completions. Strict: `"0.5"` is not a number."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: dict[str, Any] | None = None


Body = TypeVar("Body", bound=GenerationBody)


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatBody(GenerationBody):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body validated by `model`, whatever the content type says (curl's `-d` sends
    form-encoded); errors become a 400 naming the first offending field."""
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(part) for part in err["loc"]]
        raise APIError(400, f"{'.'.join(loc)}: {err['msg']}", param=loc[0] if loc else None) from None


# ---- one choice --------------------------------------------------------------------------------


@dataclasses.dataclass
class Choice:
    """The text of one engine request so far, cut before a stop string."""

    index: int
    num_prompt_tokens: int
    counts_prompt: bool  # the prompt's first choice: usage counts a prompt once, as OpenAI does
    text: TextStream
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    last: RequestDelta | None = None
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked
    offsets: list[int] = dataclasses.field(default_factory=list)  # where each token's text starts
    released: int = 0  # leading tokens whose logprobs went out in stream chunks

    def feed(self, delta: RequestDelta) -> str:
        """Take one delta; return the text it releases."""
        self.last = delta
        start = len(self.token_ids)
        self.token_ids += delta.new_token_ids
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
            decode = self.text.tokenizer.decode
            self.offsets += [len(decode(self.token_ids[:i])) for i in range(start, len(self.token_ids))]
        piece = self.text.update(self.token_ids, final=delta.finished)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif delta.finished:
            self.finish_reason = delta.finish_reason or "stop"
        return piece

    def logged(self, start: int = 0) -> list[Logged] | None:
        """The logprobs of the tokens from `start` whose text is out: while running, the text
        released so far; at the end every token but those after a stop string's start."""
        if self.logprobs is None:
            return None
        if self.finish_reason is None or self.text.stopped:
            end = self.text.sent if self.finish_reason is None else len(self.text.text)
            upto = next((i for i, at in enumerate(self.offsets) if at >= end), len(self.offsets))
        else:
            upto = len(self.offsets)
        return [Logged(self.token_ids[i], self.offsets[i], self.logprobs[i]) for i in range(start, upto)]

    def take_logprobs(self) -> list[Logged] | None:
        """`logged` tokens not yet handed out, marking them handed out."""
        out = self.logged(self.released)
        self.released += len(out or [])
        return out


class Logged(NamedTuple):
    """One generated token with where its text starts and its logprobs."""

    token_id: int
    offset: int
    logprobs: TokenLogprobs


class Piece(NamedTuple):
    """Text a choice released, and its finish reason when this is its last piece."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[Logged] | None  # tokens whose logprobs go with this text (None: not asked)


async def _pump(choice: Choice, stream: DeltaStream, emit: Callable[[Piece], None] | None) -> None:
    """Feed `stream` into `choice` until it finishes or meets a stop string (then abort it)."""
    async with contextlib.aclosing(stream):
        async for delta in stream:
            piece = choice.feed(delta)
            if emit is not None and (piece or choice.finish_reason):
                emit(Piece(choice.index, piece, choice.finish_reason, choice.take_logprobs()))
            if choice.finish_reason is not None:
                return
    choice.finish_reason = "abort"
    if emit is not None:
        emit(Piece(choice.index, "", choice.finish_reason, choice.take_logprobs()))


def usage(choices: list[Choice]) -> dict[str, Any]:
    """OpenAI usage (a prompt counts once however many choices it has) plus speculation figures."""
    firsts = [c for c in choices if c.counts_prompt]
    prompt_tokens = sum(c.num_prompt_tokens for c in firsts)
    cached = sum(c.last.num_cached_prompt_tokens for c in firsts if c.last is not None)
    completion = sum(len(c.token_ids) for c in choices)
    stats = [c.last.stats for c in choices if c.last is not None]
    forwards = sum(s.num_target_forwards for s in stats)
    tau = sum(s.num_generated_tokens for s in stats) / forwards if forwards else 0.0
    timings = [c.last.timing for c in choices if c.last is not None and c.last.timing is not None]
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "cached_prompt_tokens": cached,
        "num_draft_tokens": sum(s.num_draft_tokens for s in stats),
        "num_accepted_tokens": sum(s.num_accepted_tokens for s in stats),
        "mean_accepted_length": round(tau, 4),
        # The engine's timing: the first choice's first token, and each choice's decode speed.
        "time_to_first_token_s": round(min((t.first_token_s for t in timings), default=0.0), 4),
        "decode_tokens_per_s": [round(t.decode_tokens_per_s, 2) for t in timings],
    }


def _failure(exc: Exception) -> APIError:
    """An error met after the request was accepted, as the client should see it."""
    if isinstance(exc, SpecDecodeError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineStopped):
        return APIError(503, str(exc), kind="service_unavailable")
    return APIError(500, f"internal error: {exc!r}", kind="internal_error")


# ---- the application ---------------------------------------------------------------------------


async def _until_disconnected(request: Request) -> None:
    """Return when the client has gone (its request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The endpoints' shared state: the model, the engine thread, the served name and key."""

    def __init__(
        self,
        model: Frontend,
        engine: EngineClient,
        default_speculative: SpecConfig | None,
        model_name: str,
        api_key: str | None,
    ) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.engine = engine
        self.default_speculative = default_speculative
        self.model_name = model_name
        self.api_key = api_key
        self.context = model.context
        self.vocab_size = model.vocab_size
        self.created = int(time.time())

    # ---- checks --------------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.api_key):
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer KEY'" if not header else "invalid API key",
                kind="authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"model {name!r} is not served here (this server serves {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def check_supported(body: GenerationBody) -> None:
        for name, off in UNSUPPORTED.items():
            value = (body.model_extra or {}).get(name)
            if value is not None and not (value == off and isinstance(value, bool) == isinstance(off, bool)):
                raise APIError(400, f"{name} is not supported by this server", param=name)

    def check_prompt(self, ids: list[int], field: str) -> None:
        if not ids:
            raise APIError(400, f"{field} is empty", param=field)
        if not all(0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"{field}: token ids must be in [0, {self.vocab_size})", param=field)
        if len(ids) >= self.context:
            raise APIError(
                400,
                f"{field} has {len(ids)} tokens; the model's context is {self.context} tokens",
                param=field,
                code="context_length_exceeded",
            )

    # ---- building requests ---------------------------------------------------------------------

    def speculative(self, body: GenerationBody) -> SpecConfig | None:
        if "speculative" not in body.model_fields_set:
            return self.default_speculative
        try:
            return parse_speculative(body.speculative)
        except SpecDecodeError as exc:
            raise APIError(400, f"speculative: {exc}", param="speculative") from None

    def params(
        self,
        body: GenerationBody,
        max_tokens: int | None,
        longest_prompt: int,
        default: int,
        logprobs: int | None = None,
    ) -> SamplingParams:
        room = self.context - longest_prompt
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, but the prompt leaves room for {room} of the "
                f"model's {self.context} tokens of context",
                param="max_tokens",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else min(default, room),
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=stop,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except SpecDecodeError as exc:
            raise APIError(400, str(exc)) from None

    def requests(
        self, prefix: str, prompts: list[list[int]], body: GenerationBody, params: SamplingParams
    ) -> tuple[list[EngineRequest], list[Choice]]:
        """One engine request per choice; with a seed, choice k samples with seed + k."""
        spec = self.speculative(body)
        reqs, choices = [], []
        for i, ids in enumerate(prompts):
            for j in range(body.n):
                index = i * body.n + j
                seed = None if params.seed is None else params.seed + index
                reqs.append(
                    EngineRequest(f"{prefix}-{index}", ids, dataclasses.replace(params, seed=seed), spec)
                )
                text = TextStream(self.tokenizer, params.stop)
                logprobs = None if params.logprobs is None else []
                choices.append(Choice(index, len(ids), j == 0, text, logprobs=logprobs))
        return reqs, choices

    async def submit(self, reqs: list[EngineRequest]) -> list[DeltaStream]:
        """Add every request at once (the engine thread takes them between two steps); if the
        engine refuses one, abort the others and answer with its error."""
        added = await asyncio.gather(*(self.engine.generate(req) for req in reqs), return_exceptions=True)
        streams = [r for r in added if not isinstance(r, BaseException)]
        if len(streams) < len(reqs):
            for stream in streams:
                await stream.aclose()
            failure = next(r for r in added if isinstance(r, BaseException))
            if not isinstance(failure, Exception):
                raise failure  # cancelled
            raise _failure(failure)
        return streams

    # ---- answering -----------------------------------------------------------------------------

    async def answer(
        self,
        request: Request,
        body: GenerationBody,
        reqs: list[EngineRequest],
        choices: list[Choice],
        shape: Shape,
    ) -> Response:
        streams = await self.submit(reqs)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self.events(streams, choices, shape, include_usage), media_type="text/event-stream"
            )
        gone = asyncio.ensure_future(_until_disconnected(request))
        work = asyncio.ensure_future(_collect(choices, streams))
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: cancelling the pumps aborts every choice
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)
        gone.cancel()
        if work.exception() is not None:
            raise _failure(work.exception())  # type: ignore[arg-type]
        return JSONResponse(shape.whole(choices, usage(choices)))

    async def events(
        self, streams: list[DeltaStream], choices: list[Choice], shape: Shape, include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: chunks as text arrives, then usage if asked, then `[DONE]`.

        If the client disconnects, Starlette cancels this generator; cancelling the pumps aborts
        every choice still running."""
        queue: asyncio.Queue[Piece | Exception] = asyncio.Queue()

        async def pump(choice: Choice, stream: DeltaStream) -> None:
            try:
                await _pump(choice, stream, queue.put_nowait)
            except Exception as exc:
                queue.put_nowait(exc)

        pumps = [asyncio.ensure_future(pump(c, s)) for c, s in zip(choices, streams, strict=True)]
        try:
            for choice in choices:
                if (opening := shape.opening(choice)) is not None:
                    yield _sse(opening)
            pending = len(choices)
            while pending:
                item = await queue.get()
                if isinstance(item, Exception):
                    yield _sse(_failure(item).body())
                    break
                yield _sse(shape.chunk(item, include_usage))
                pending -= item.finish_reason is not None
            else:
                if include_usage:
                    yield _sse(shape.usage_chunk(usage(choices)))
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def _collect(choices: list[Choice], streams: list[DeltaStream]) -> None:
    """Run every choice to its end; the first failure cancels (and so aborts) the others."""
    try:
        async with asyncio.TaskGroup() as group:
            for choice, stream in zip(choices, streams, strict=True):
                group.create_task(_pump(choice, stream, None))
    except ExceptionGroup as failures:
        raise failures.exceptions[0] from None


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Shape:
    """How one endpoint spells its responses (completions and chat completions differ)."""

    def __init__(
        self, kind: Literal["completion", "chat"], request_id: str, model: str, tokenizer: Tokenizer
    ) -> None:
        self.kind, self.id, self.model, self.created = kind, request_id, model, int(time.time())
        self.tokenizer = tokenizer

    def logprobs(self, logged: list[Logged] | None) -> dict[str, Any] | None:
        """The `logprobs` of a choice or chunk: completions' parallel lists (`top_logprobs` maps
        token text to logprob, the chosen token included, as the legacy API does), or chat's
        `content` entries (`top_logprobs` the N most likely, most likely first)."""
        if logged is None:
            return None
        text = self._token_text
        if self.kind == "completion":
            tops = []
            for token, _, lp in logged:
                top: dict[str, float] = {}
                for t, v in [*lp.top, (token, lp.logprob)]:  # tokens of the same text: the likeliest
                    top.setdefault(text(t), max(v, LOGPROB_FLOOR))
                tops.append(top)
            return {
                "tokens": [text(t.token_id) for t in logged],
                "token_logprobs": [max(t.logprobs.logprob, LOGPROB_FLOOR) for t in logged],
                "top_logprobs": tops,
                "text_offset": [t.offset for t in logged],
            }

        def entry(token: int, logprob: float) -> dict[str, Any]:
            s = text(token)
            return {"token": s, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(s.encode())}

        content = [
            {
                **entry(t.token_id, t.logprobs.logprob),
                "top_logprobs": [entry(i, v) for i, v in t.logprobs.top],
            }
            for t in logged
        ]
        return {"content": content}

    def _token_text(self, token: int) -> str:
        """One token's text, special tokens spelled out (a token that is part of a multi-byte
        character reads as U+FFFD, as in vLLM)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "completion":
            body = [
                {
                    "index": c.index,
                    "text": c.text.text,
                    "logprobs": self.logprobs(c.logged()),
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
            return {**self._head("text_completion"), "choices": body, "usage": usage}
        body = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text.text},
                "logprobs": self.logprobs(c.logged()),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        return {**self._head("chat.completion"), "choices": body, "usage": usage}

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant's role, as OpenAI does."""
        if self.kind == "completion":
            return None
        delta = {"role": "assistant", "content": ""}
        entry = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [entry]}

    def chunk(self, piece: Piece, include_usage: bool) -> dict[str, Any]:
        if self.kind == "completion":
            entry = {
                "index": piece.index,
                "text": piece.text,
                "logprobs": self.logprobs(piece.logprobs),
                "finish_reason": piece.finish_reason,
            }
            out = {**self._head("text_completion"), "choices": [entry]}
        else:
            entry = {
                "index": piece.index,
                "delta": {"content": piece.text} if piece.text else {},
                "logprobs": self.logprobs(piece.logprobs),
                "finish_reason": piece.finish_reason,
            }
            out = {**self._head("chat.completion.chunk"), "choices": [entry]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        name = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(name), "choices": [], "usage": usage}


def create_app(
    model: LLM | Frontend,
    engine: EngineClient,
    default_speculative: SpecConfig | None = None,
    model_name: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI application over a started `engine`. `model_name` is the id clients must send
    (default: the name the model was loaded by)."""
    front = Frontend.of(model) if isinstance(model, LLM) else model
    server = Server(front, engine, default_speculative, model_name or front.name, api_key)
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return _failure(exc).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind=kind).response()

    authorized = [Depends(server.check_key)]

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionBody)
        server.check_model(body.model)
        server.check_supported(body)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt else [body.prompt]
        if isinstance(prompts[0], int):
            prompts = [prompts]
        ids = [
            server.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            for p in prompts
        ]
        for prompt_ids in ids:
            server.check_prompt(prompt_ids, "prompt")
        params = server.params(body, body.max_tokens, max(map(len, ids)), 16, body.logprobs)
        prefix = f"cmpl-{uuid.uuid4().hex}"
        reqs, choices = server.requests(prefix, ids, body, params)
        return await server.answer(
            request, body, reqs, choices, Shape("completion", prefix, server.model_name, server.tokenizer)
        )

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatBody)
        server.check_model(body.model)
        server.check_supported(body)
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            ids = server.model.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        except SpecDecodeError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        server.check_prompt(ids, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = server.params(body, max_tokens, len(ids), server.context, logprobs)
        prefix = f"chatcmpl-{uuid.uuid4().hex}"
        reqs, choices = server.requests(prefix, [ids], body, params)
        return await server.answer(
            request, body, reqs, choices, Shape("chat", prefix, server.model_name, server.tokenizer)
        )

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "specdecode",
            "max_model_len": server.context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.alive:
            return APIError(503, "the engine has stopped", kind="internal_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await server.engine.replica_stats()
        return PlainTextResponse(render(stats), media_type="text/plain; version=0.0.4")

    return app


def serve(
    llm: LLM,
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
) -> None:
    """Serve `llm` until interrupted: the engine on its thread, uvicorn on this one."""
    import uvicorn

    engine = AsyncEngine(llm.new_engine(config))
    # The model, tokenizer and engine live as long as the server: frozen out of the collector's
    # scans, so that no full collection over them (120-180 ms for SmolLM2's) stalls every stream.
    gc.collect()
    gc.freeze()
    engine.start()
    try:
        app = create_app(llm, engine, config.speculative, model_name, api_key)
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.shutdown()
