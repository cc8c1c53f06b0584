"""The serving engine on one background thread, for asyncio callers (the HTTP server).

Only that thread touches the engine and the model. Callers post commands (add, abort) to an
inbox; the thread applies them between engine steps and hands each request's `RequestDelta`s
to the event loop the request came from (`loop.call_soon_threadsafe`). With nothing to run and
an empty inbox the thread sleeps on a condition variable rather than spinning.

    stream = await engine.generate(req)       # raises the engine's SpecDecodeError on bad input
    async with contextlib.aclosing(stream):   # leaving early (disconnect, stop string) aborts
        async for delta in stream: ...
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

from specdecode.engine.llm_engine import EngineRequest, EngineStats, LLMEngine, RequestDelta
from specdecode.errors import SpecDecodeError

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine thread was shut down while the request ran (or before it was added)."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


ACCEPTED = _Marker("ACCEPTED")  # add_request succeeded: deltas follow
ABORTED = _Marker("ABORTED")  # the request was aborted: nothing follows

Item = RequestDelta | BaseException | _Marker


@dataclass
class _Route:
    """Where one request's deltas go: a queue owned by the event loop that submitted it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item]

    def put(self, item: Item) -> bool:
        """Hand `item` to the event loop; False when that loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class DeltaStream(ABC):
    """The deltas of one accepted request, ending after the finished one (or at an error, or
    when the request was aborted). `aclose()` before the end cancels the request where it runs,
    so its KV blocks are freed."""

    done = False

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.done:
            raise StopAsyncIteration
        try:
            delta = await self._next()
        except Exception:  # the end or an error; a cancelled reader (CancelledError) still aborts
            self.done = True
            raise
        self.done = delta.finished
        return delta

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self._cancel()

    @abstractmethod
    async def _next(self) -> RequestDelta:
        """The next delta; StopAsyncIteration when the request was aborted."""

    @abstractmethod
    def _cancel(self) -> None: ...


class RequestStream(DeltaStream):
    """A request of this process's engine thread: its deltas come through an asyncio queue."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[Item]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue = queue

    async def _next(self) -> RequestDelta:
        item = await self.queue.get()
        if item is ABORTED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, RequestDelta)
        return item

    def _cancel(self) -> None:
        self.engine.abort(self.request_id)


class AsyncEngine:
    """Runs `engine` on a thread of its own; `generate` and `abort` may be called from any loop."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._wake = threading.Condition()  # guards everything below
        self._inbox: deque[EngineRequest | str] = deque()  # a request to add, or an id to abort
        self._routes: dict[str, _Route] = {}
        self._stopping = False
        self._stats = copy.deepcopy(engine.stats)
        self._running: set[str] = set()  # ids in the engine; the engine thread's own
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specdecode-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still running end with an error."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._wake:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.put(EngineStopped("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        """A copy of the engine's counters taken after its latest step (safe to read from any thread)."""
        with self._wake:
            return self._stats

    async def replica_stats(self) -> dict[str, EngineStats]:
        """The counters as the server's `/metrics` takes them: one engine, no replica name."""
        return {"": self.stats}

    # ---- callers' side -------------------------------------------------------------------------

    async def generate(self, req: EngineRequest) -> RequestStream:
        """Submit `req`; returns its delta stream once the engine accepted it, or raises the
        engine's error (a `SpecDecodeError` for bad input)."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        with self._wake:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if req.request_id in self._routes:
                raise SpecDecodeError(f"request_id {req.request_id!r} is already running")
            self._routes[req.request_id] = _Route(asyncio.get_running_loop(), queue)
            self._inbox.append(req)
            self._wake.notify()
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            self.abort(req.request_id)
            raise
        if isinstance(first, BaseException):
            raise first
        assert first is ACCEPTED, first
        return RequestStream(self, req.request_id, queue)

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop `request_id` (a no-op once it has finished)."""
        with self._wake:
            if request_id in self._routes:
                self._inbox.append(request_id)
                self._wake.notify()

    # ---- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        busy = False
        while True:
            with self._wake:
                while not (self._inbox or busy or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, deque()
            for command in commands:
                if isinstance(command, str):
                    self._abort(command)
                else:
                    self._add(command)
            if self.engine.has_unfinished():
                self._step()
            busy = self.engine.has_unfinished()
            stats = copy.deepcopy(self.engine.stats)
            with self._wake:
                self._stats = stats

    def _route(self, request_id: str, pop: bool) -> _Route | None:
        with self._wake:
            return self._routes.pop(request_id, None) if pop else self._routes.get(request_id)

    def _add(self, req: EngineRequest) -> None:
        try:
            self.engine.add_request(req)
        except Exception as exc:  # bad input (SpecDecodeError) or an engine bug: the caller gets it
            if not isinstance(exc, SpecDecodeError):
                log.exception("add_request failed for %s", req.request_id)
            route = self._route(req.request_id, pop=True)
            if route is not None:
                route.put(exc)
            return
        route = self._route(req.request_id, pop=False)
        if route is None:  # failed by a broken step while it waited in the inbox
            self.engine.abort(req.request_id)
        elif not route.put(ACCEPTED):  # its event loop has closed
            self._abort(req.request_id)
        else:
            self._running.add(req.request_id)

    def _abort(self, request_id: str) -> None:
        route = self._route(request_id, pop=True)
        if route is None:
            return  # finished (or failed) before the abort was applied
        self.engine.abort(request_id)
        self._running.discard(request_id)
        route.put(ABORTED)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:
            # The engine cannot say which request broke the step, so every running one fails
            # (and is dropped from the engine); the loop itself goes on serving new requests.
            log.exception("engine step failed")
            failed, self._running = self._running, set()
            for request_id in failed:
                route = self._route(request_id, pop=True)
                try:
                    self.engine.abort(request_id)
                except Exception:
                    log.exception("abort after a failed step failed for %s", request_id)
                if route is not None:
                    route.put(exc)
            return
        for delta in deltas:
            if delta.finished:
                self._running.discard(delta.request_id)
            route = self._route(delta.request_id, pop=delta.finished)
            if route is not None and not route.put(delta):
                self._abort(delta.request_id)
