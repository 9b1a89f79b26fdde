"""Blocking twins of the async emitters, for agents and sources without an event loop.

Each facade runs its emitter on an event loop in a daemon thread of its own. Its methods are made from the async
emitter's by `blocking`, so they keep its names, signatures and docs, and a method added there needs one line here.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future as ConcurrentFuture
from types import TracebackType
from typing import Any, ClassVar, Self, TypeVar

from streams.sdk.emitter import _Emitter
from streams.sdk.outcomes import Outcome
from streams.sdk.rewards import RewardEmitter
from streams.sdk.stream import AgentStream
from streams.sdk.types import StepRef, StreamError, ToolCall

T = TypeVar("T")


class _LoopThread:
    """An event loop in a daemon thread, owned by one facade; calls block until their coroutine returns."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a sync treadle stream was called from its own event-loop thread (would deadlock)")
        if self.loop.is_closed():
            coro.close()
            raise StreamError("the stream is closed")
        future: ConcurrentFuture[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self._cancel_leftovers())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    @staticmethod
    async def _cancel_leftovers() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_asyncgens()


class _ForeignLoop:
    """Calls into an event loop that another thread runs and owns (an Executor's): stopping it is not ours."""

    thread = None

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("a sync treadle stream was called from its own event loop (would deadlock)")
        if self.loop.is_closed():
            coro.close()
            raise StreamError("the stream is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        pass


def _close_forgotten(runner: _LoopThread, inner: _Emitter) -> None:
    """A facade dropped (or the interpreter exiting) without close(): deliver its events rather than lose them."""
    if runner.loop.is_closed() or threading.current_thread() is runner.thread:
        return
    warnings.warn("a treadle sync stream was not closed; flushing it now", ResourceWarning, stacklevel=1)
    try:
        runner.call(inner.close())
    finally:
        runner.stop()


def blocking(method: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """The blocking twin of an async emitter method: same name, signature and docs, run on the facade's loop."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: _SyncFacade, *args: Any, **kwargs: Any) -> T:
        return self._runner.call(getattr(self._inner, name)(*args, **kwargs))

    return call


def forwarded(name: str) -> property:
    """A read-only attribute of the wrapped emitter."""
    return property(lambda self: getattr(self._inner, name), doc=f"The wrapped emitter's `{name}`.")


class _SyncFacade:
    """A background event loop running one async emitter of `emitter_class`, built with the facade's arguments."""

    emitter_class: ClassVar[type[_Emitter]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._inner = self.emitter_class(*args, **kwargs)
        self._runner = _LoopThread(f"treadle-{type(self).__name__}-{id(self):x}")
        self._finalizer = weakref.finalize(self, _close_forgotten, self._runner, self._inner)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give the facade's constructor the emitter's signature and docs (for help() and editors)."""
        super().__init_subclass__(**kwargs)
        emitter_class = cls.__dict__.get("emitter_class")
        if emitter_class is not None:
            cls.__init__ = functools.wraps(emitter_class.__init__)(_SyncFacade.__init__)  # type: ignore[method-assign]

    @classmethod
    def over(cls, inner: _Emitter, loop: asyncio.AbstractEventLoop) -> Self:
        """A facade for a started emitter that lives on `loop`, run by another thread (an Executor's handler threads
        share its loop and producer this way). `close()` closes the emitter but leaves the loop running; an emitter
        the caller does not close is the loop owner's to close."""
        facade = cls.__new__(cls)
        facade._inner = inner
        facade._runner = _ForeignLoop(loop)  # type: ignore[assignment]
        facade._finalizer = weakref.finalize(facade, int)  # nothing to do: the owner closes the emitter
        return facade

    def start(self) -> Self:
        """Connect to Kafka; blocks until the producer is ready."""
        self._runner.call(self._inner.start())
        return self

    def flush(self, timeout: float | None = None) -> None:
        """Block until every event sent so far is acknowledged; raise ProducerError if any failed."""
        self._runner.call(self._inner.flush(timeout))

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the producer and the background loop. Idempotent."""
        self._finalizer.detach()
        if self._runner.loop.is_closed():
            return
        try:
            self._runner.call(self._inner.close(timeout))
        finally:
            self._runner.stop()

    @property
    def pending(self) -> int:
        return self._inner.pending

    @property
    def spool_depth(self) -> int:
        """Events waiting in the producer spool (TREADLE_SPOOL_DIR) for the brokers."""
        return self._inner.spool_depth

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:
            exc.add_note(f"also, while closing the treadle stream: {close_error!r}")


class AgentStreamSync(_SyncFacade):
    """AgentStream for agents without an event loop: same methods, blocking only until the event is handed off.

    Runs its own event loop in a background thread (one per facade) and its own producer.
    Use `with AgentStreamSync(...) as stream:` or `start()` ... `close()`.
    """

    emitter_class: ClassVar[type[_Emitter]] = AgentStream
    _inner: AgentStream

    session_id = forwarded("session_id")
    episode_id = forwarded("episode_id")
    agent_id = forwarded("agent_id")
    next_step = forwarded("next_step")
    next_seq = forwarded("next_seq")
    dispatch = blocking(AgentStream.dispatch)
    tool_result = blocking(AgentStream.tool_result)
    reward = blocking(AgentStream.reward)
    delta = blocking(AgentStream.delta)
    lifecycle = blocking(AgentStream.lifecycle)
    llm_call = blocking(AgentStream.llm_call)
    llm_call_from_openai = blocking(AgentStream.llm_call_from_openai)
    outcome = blocking(AgentStream.outcome)
    submit_plan = blocking(AgentStream.submit_plan)

    def outcomes(self) -> Iterator[Outcome]:
        """See AgentStream.outcomes; a blocking generator (close it, or leave the loop, to stop reading)."""
        iterator = self._inner.outcomes()
        try:
            while True:
                try:
                    yield self._runner.call(anext(iterator))
                except StopAsyncIteration:
                    return
        finally:
            if not self._runner.loop.is_closed():
                self._runner.call(iterator.aclose())

    def tool_call(self, step: StepRef) -> _SyncToolCallContext:
        """See AgentStream.tool_call; a plain `with` block, timed in the caller's thread."""
        return _SyncToolCallContext(self, step)


class _SyncToolCallContext:
    def __init__(self, facade: AgentStreamSync, step: StepRef) -> None:
        self._facade = facade
        self._call = ToolCall(step)

    def __enter__(self) -> ToolCall:
        self._facade._inner._check_ready()
        self._call._started = time.perf_counter()
        return self._call

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False
        self._call._finish(exc)
        try:
            self._facade._runner.call(self._facade._inner._emit_tool_call(self._call, exc))
        except Exception as emit_error:
            if exc is None:
                raise
            exc.add_note(f"treadle could not record this tool call's result: {emit_error!r}")
        return False


class RewardEmitterSync(_SyncFacade):
    """RewardEmitter for sources without an event loop (a labelling UI, a batch job)."""

    emitter_class: ClassVar[type[_Emitter]] = RewardEmitter
    reward = blocking(RewardEmitter.reward)
