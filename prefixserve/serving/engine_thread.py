"""The engine thread: the one place the server touches the Engine.

HTTP handlers run on an asyncio loop; a forward pass blocks for milliseconds to seconds. So the Engine
lives on its own thread, stepping while there is work and sleeping on its command queue when there is
none. Handlers send commands (add, abort, call) through a thread-safe queue; the thread hands outputs
back to each request's asyncio queue with ``loop.call_soon_threadsafe`` (one call per loop per step).
Commands are applied in order, so an abort sent after an add always finds its request. ``run`` awaits
any callable on the engine thread between two steps (registering a Prompt Cache schema runs forwards,
so it must happen there); commands still queued when the thread stops fail with EngineStopped.

Overload (``serving/admission.py``): with ``limits``, the loop keeps an ``Admission`` beside the engine;
an add past the waiting queue's bounds fails with ``QueueFull``, and before each step the requests
that cannot start by their deadline are dropped (they end with finish_reason ``DEADLINE_REASON``).
After every step, and after a batch of adds, the loop publishes the queue (``queue_state``, a
``QueueState``), from which the HTTP side refuses most requests at arrival without waiting for the
loop (``overload.ArrivalGate``); an add carries the ``arrival`` number that gate gave it, and the
published state says up to which number the engine has decided.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prefixserve.engine import Engine
from prefixserve.model.parallel import WorkerDiedError
from prefixserve.outputs import RequestOutput
from prefixserve.pooling_params import PoolingParams
from prefixserve.promptcache.pml import PMLError
from prefixserve.sampling.params import SamplingParams
from prefixserve.serving.admission import Admission, AdmissionLimits, QueueFull, QueueState

log = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.5  # how long the idle thread sleeps on its queue before re-checking for stop
OS_THREAD_NAME = "ps-engine"  # what top -H, py-spy and /proc/PID/task/TID/comm show for the engine thread


class LatencyObserver(Protocol):
    """Receives per-request latencies (seconds) from the engine thread (e.g. Prometheus histograms)."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float, count: int) -> None: ...
    def request_done(self, seconds: float) -> None: ...
    def tenant_done(
        self, tenant: str | None, computed: int, cached: int, generated: int, queue_s: float
    ) -> None:
        """A finished request's tokens and queue time, by its tenant (the request's ``user``)."""

    def path(self, stage: str, seconds: float) -> None:
        """One stage of a request's way in or its first token's way out (the server's
        ``metrics.PATH_STAGES``)."""


class StreamSink(asyncio.Queue):
    """A streamed request's queue of outputs, with backpressure: at most one output in flight.

    Outputs are cumulative, so a stream whose reader has not taken the last one need not get the
    next: after delivering one, the engine thread stops building outputs for the request
    (``Request.stream = False``) and parks it in ``paused``; the reader, once it has written what it
    took, ``resume``s it, and the next step's output carries every token since. A reader that keeps
    up sees every step; a busy server builds, queues and formats fewer outputs (under load the
    reader and the engine thread share one GIL). Final outputs always come.
    """

    def __init__(self) -> None:
        super().__init__()
        self.paused: collections.deque[Any] = collections.deque()  # thread-safe append / popleft
        # time.monotonic() when the delivering thread handed over this stream's first output (the
        # start of the "first output to first write" stage; set once, by that thread)
        self.first_received: float | None = None

    def resume(self) -> None:
        """The reader is ready for more: the paused requests get outputs again from the next step."""
        paused = self.paused
        while paused:
            paused.popleft().stream = True


@dataclass(slots=True, eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[RequestOutput]
    stream: bool
    tokens: int = 0  # tokens of sample 0 seen so far (for inter-token latency)
    last_time: float = 0.0
    request: Any = None  # the engine's Request (engine thread): paused while its reader is behind
    handed: float | None = None  # time.monotonic() when the route handed it over (None: not timed)
    tenant: str | None = None  # the request's tenant, for the per-tenant counters


_Item = tuple["asyncio.Queue[RequestOutput]", RequestOutput]


class EngineStopped(RuntimeError):
    """The engine thread is shutting down and takes no new requests."""


class EngineLoop:
    """Runs an Engine on a dedicated thread; all methods except the thread's own are thread-safe."""

    def __init__(
        self, engine: Engine, observer: LatencyObserver | None = None, limits: AdmissionLimits | None = None
    ) -> None:
        self.engine = engine
        self.admission = None if limits is None else Admission(engine, limits)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        snapshot = engine_metrics(engine, self.admission)
        state = None if self.admission is None else self.admission.state()
        self._init_delivery(observer, snapshot, state, self._run, "prefixserve-engine")

    def _init_delivery(
        self,
        observer: LatencyObserver | None,
        snapshot: dict[str, float],
        queue_state: QueueState | None,
        target: Callable[[], None],
        name: str,
    ) -> None:
        """What delivering outputs and taking commands needs, with the thread that runs ``target``."""
        self.observer = observer
        self.snapshot: dict[str, float] = snapshot  # replaced (not mutated) by the delivering thread
        # the waiting queue as the engine last published it (None: no admission); replaced likewise
        self.queue_state: QueueState | None = queue_state
        self._streams: dict[str, _Stream] = {}  # the delivering thread's
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._stopping = False
        self._closed = False  # the thread has drained its queue for the last time (under _lock)
        self._lock = threading.Lock()

    # ---- the asyncio side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running (its streams get a final 'abort' output), then end the thread."""
        self._stopping = True
        self._put(("stop",))
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        """Requests registered here whose final output has not been delivered."""
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def add(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | None,
        sink: asyncio.Queue[RequestOutput],
        *,
        pooling: PoolingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        public_tokens: int = 0,
        tenant: str | None = None,
        cache_pins: list[tuple[int, float]] | None = None,
        application: str | None = None,
        stream: bool = False,
        module_recompute: str | None = None,
        deadline: float | None = None,
        arrival: int | None = None,
        started: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; returns once the engine accepted it, raises ValueError if it refused it
        (QueueFull past the queue's bounds). ``deadline``: the ``time.monotonic()`` by which it must
        have started, or it is dropped (its final output has finish_reason ``DEADLINE_REASON``).
        ``arrival``: its number from ``overload.ArrivalGate``, acknowledged in ``queue_state``.
        ``started``: when its route began (``time.monotonic()``), for the "intake" stage.
        ``pooling``: an embedding request (``params`` None)."""
        if not self.alive:
            raise EngineStopped(self._refusal())
        handed = time.monotonic()
        if started is not None and self.observer is not None:
            self.observer.path("intake", handed - started)
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[None] = loop.create_future()
        kwargs: dict[str, Any] = dict(
            prompt_token_ids=prompt_token_ids,
            cache_salt=cache_salt,
            stream=stream,
            application=application,
            module_recompute=module_recompute,
            queue_deadline=deadline,
            arrival=arrival,
            priority=priority,
        )
        if pooling is not None:  # an embedding request (the engine makes its params)
            kwargs["pooling"] = pooling
        if public_tokens:  # a salted prompt's public part (--cache-salt-scope)
            kwargs["public_tokens"] = public_tokens
        if tenant is not None:  # whose share it draws on (--scheduling-policy fair)
            kwargs["tenant"] = tenant
        if cache_pins:  # cache breakpoints held for their TTLs (engine/cache_pins.py)
            kwargs["cache_pins"] = cache_pins
        if not self._queue_add(
            (
                request_id,
                prompt,
                params,
                kwargs,
                _Stream(loop, sink, stream, handed=handed, tenant=tenant),
                accepted,
            )
        ):
            raise EngineStopped("the server is shutting down")
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine saw the request
            self.abort(request_id)
            raise

    def _refusal(self) -> str:
        """Why a request is refused while the loop is not alive."""
        return "the server is shutting down"

    def _queue_add(self, add: tuple[Any, ...]) -> bool:
        """Send ``(request_id, prompt, params, kwargs, stream, accepted)`` to the engine (``_add``)."""
        return self._put(("add", *add))

    def abort(self, request_id: str, report: bool = False) -> None:
        """Stop a request and free its blocks; nothing more is delivered for it, unless ``report``:
        then its final output (finish_reason "abort") still comes."""
        self._put(("abort", request_id, report))

    def abort_all(self) -> None:
        """Stop every request, each stream getting a final output with finish_reason 'abort'."""
        self._put(("abort_all",))

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps (test hooks, introspection, schemas).

        The future fails with EngineStopped if the thread stops first; cancelled before it runs,
        ``fn`` is skipped.
        """
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self._put(("call", fn, done)):
            done.set_exception(EngineStopped("the server is shutting down"))
        return done

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """Await ``fn(engine)`` run on the engine thread; its exception is raised here."""
        if not self.alive:
            raise EngineStopped("the server is shutting down")
        return await asyncio.wrap_future(self.call(fn))

    def _put(self, command: tuple[Any, ...]) -> bool:
        """Queue a command; False once the thread has stopped taking them."""
        with self._lock:
            if self._closed:
                return False
            self._commands.put(command)
            return True

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(OS_THREAD_NAME)
        engine = self.engine
        while True:
            if engine.has_unfinished():
                command = self._next_nowait()
            else:
                try:
                    command = self._commands.get(timeout=IDLE_WAIT_S)
                except queue.Empty:
                    command = None
            stop = added = False
            while command is not None:
                stop = self._apply(command) or stop
                added = added or command[0] == "add"
                command = self._next_nowait()
            if stop:
                self._shutdown()
                return
            if added:  # the arrivals' decisions, before a step that may take long
                self._publish_queue()
            if engine.has_unfinished():
                outputs, dead = serve_step(engine, self.admission)
                if dead:  # no step can run again: take nothing more (not alive before the failed
                    self._refuse_queued()  # requests hear of it), and let the other ranks go now
                    self._deliver(outputs)
                    self._release_engine()
                    return
                self._deliver(outputs)
            self.snapshot = engine_metrics(engine, self.admission)
            self._publish_queue()

    def _publish_queue(self) -> None:
        if self.admission is not None:
            self.queue_state = self.admission.state()

    def _next_nowait(self) -> tuple[Any, ...] | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command: tuple[Any, ...]) -> bool:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            report = command[2]
            if not report:
                self._streams.pop(command[1], None)
            self.engine.abort(command[1], report=report)
        elif kind == "abort_all":
            self._abort_everything()
        elif kind == "call":
            fn, done = command[1], command[2]
            if not done.set_running_or_notify_cancel():  # its caller left before it ran
                return False
            try:
                done.set_result(fn(self.engine))
            except Exception as exc:
                done.set_exception(exc)
        elif kind == "stop":
            return True
        return False

    def _add(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        kwargs: dict[str, Any],
        stream: _Stream,
        accepted: asyncio.Future[None],
    ) -> None:
        if accepted.cancelled():
            if self.admission is not None:  # decided: its client left first
                self.admission.arrived(kwargs.get("arrival"))
            return
        stream.request, error = add_or_refuse(self.engine, request_id, prompt, params, kwargs, self.admission)
        if error is None:
            stream.last_time = time.monotonic()
            self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_resolve, accepted, error)

    def _abort_everything(self) -> None:
        abort_everything(self.engine)

    def _shutdown(self) -> None:
        self._abort_everything()
        self._deliver(self.engine.step())
        self.snapshot = engine_metrics(self.engine, self.admission)
        self._refuse_queued()
        self.engine.shutdown()  # tensor-parallel workers stop with the server

    def _release_engine(self) -> None:
        """After a lost tensor-parallel worker: stop the other ranks and leave the group now, not when
        the server exits (until then they would hold their devices, blocked in a collective)."""
        try:
            self.engine.shutdown()
        except Exception:  # the server goes on answering 503 whatever happens here
            log.exception("releasing the engine after a lost worker failed")

    def _refuse_queued(self) -> None:
        """Take no more commands, and fail those still queued."""
        self._stopping = True
        with self._lock:  # nothing is queued from here on: fail what still is
            self._closed = True
        stopped = EngineStopped("the server is shutting down")
        while (command := self._next_nowait()) is not None:
            if command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(stopped)
            elif command[0] == "add":
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    command[5].loop.call_soon_threadsafe(_resolve, command[6], stopped)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Item]] = {}
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)  # (an abort may have taken it meanwhile)
            elif stream.stream and isinstance(stream.sink, StreamSink) and stream.request is not None:
                stream.request.stream = False  # no more outputs until the reader took this one
                stream.sink.paused.append(stream.request)
            if stream.handed is not None:  # its first output: the engine's arrival is known now
                self._first_output(stream, out, now)
            self._observe(stream, out, now)
            by_loop.setdefault(stream.loop, []).append((stream.sink, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: its clients are gone
                loop.call_soon_threadsafe(_put_all, items)

    def _first_output(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        """A request's first output reached this process: the "to_engine" stage (handed over here to
        created by the engine), and when its stream's reader got something to write."""
        handed, stream.handed = stream.handed, None
        sink = stream.sink
        if isinstance(sink, StreamSink) and sink.first_received is None:
            sink.first_received = now
        arrival = out.metrics.get("arrival_time")
        if self.observer is not None and arrival is not None and handed is not None:
            self.observer.path("to_engine", arrival - handed)

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        obs = self.observer
        if obs is None or not out.outputs:
            return
        tokens = len(out.outputs[0].token_ids)
        if tokens > stream.tokens:
            if stream.tokens == 0:
                first = out.metrics.get("first_token_time", now)
                obs.first_token(first - out.metrics.get("arrival_time", first))
                obs.path("from_engine", now - first)  # pipe, reader thread (process) or nothing (thread)
                if not stream.stream and tokens > 1:  # only the final output came: spread the rest evenly
                    obs.inter_token((now - first) / (tokens - 1), tokens - 1)
            else:
                obs.inter_token((now - stream.last_time) / (tokens - stream.tokens), tokens - stream.tokens)
            stream.tokens, stream.last_time = tokens, now
        if out.finished:
            obs.request_done(out.metrics.get("finish_time", now) - out.metrics.get("arrival_time", now))
            times, cached = out.metrics, out.num_cached_tokens
            queued = times.get("scheduled_time", now) - times.get("arrival_time", now)
            generated = sum(len(c.token_ids) for c in out.outputs)
            obs.tenant_done(stream.tenant, out.num_prompt_tokens - cached, cached, generated, queued)


def add_or_refuse(
    engine: Engine,
    request_id: str,
    prompt: str | None,
    params: SamplingParams,
    kwargs: dict[str, Any],
    admission: Admission | None = None,
) -> tuple[Any, BaseException | None]:
    """``engine.add_request``: (the Request, None), or (None, the error to hand the caller): a full
    queue is QueueFull, a bad request a ValueError (a PMLError names line and column), anything else a
    RuntimeError. ``kwargs["queue_deadline"]`` and ``kwargs["arrival"]`` go to ``admission`` (ignored
    without one)."""
    kwargs = dict(kwargs)
    deadline = kwargs.pop("queue_deadline", None)
    arrival = kwargs.pop("arrival", None)
    if admission is not None:
        kwargs["admit"] = admission.gate(deadline, arrival)
    try:
        return engine.add_request(request_id, prompt, params, **kwargs), None
    except QueueFull as exc:
        return None, exc
    except PMLError as exc:  # a Prompt Cache prompt naming an unknown schema or module, ...
        return None, PMLError(exc.problem, exc.line, exc.column)
    except (ValueError, TypeError) as exc:  # UnicodeError is a ValueError
        return None, ValueError(str(exc))
    except Exception as exc:
        log.exception("add_request failed")
        return None, RuntimeError(f"the engine could not take the request: {exc}")


def serve_step(engine: Engine, admission: Admission | None) -> tuple[list[RequestOutput], bool]:
    """A server's step: the queue's hopeless requests dropped first (their final outputs come with
    this step's), then ``guarded_step``."""
    if admission is not None:
        admission.before_step()
    return guarded_step(engine)


def engine_metrics(engine: Engine, admission: Admission | None) -> dict[str, float]:
    """The engine's metrics, with the admission's counters and gauges when there is one."""
    out = engine.metrics()
    if admission is not None:
        out.update(admission.metrics())
    return out


def guarded_step(engine: Engine) -> tuple[list[RequestOutput], bool]:
    """One engine step: (its outputs, False), or, once a tensor-parallel worker died and no step
    can run again, (every request's failed final output, True)."""
    try:
        return engine.step(), False
    except WorkerDiedError:
        log.exception("the engine lost a tensor-parallel worker; the server stops serving")
        return engine.fail_all(), True
    except Exception:  # the engine guards its steps; this is a last resort
        log.exception("engine step raised; aborting every request")
        abort_everything(engine)
        return engine.step(), False


def abort_everything(engine: Engine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id, report=True)


def name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (Linux, 15 bytes at most), so that per-thread CPU time can be
    told apart from outside the process; Python before 3.14 names none. Elsewhere it does nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(items: list[_Item]) -> None:
    for sink, out in items:
        sink.put_nowait(out)
