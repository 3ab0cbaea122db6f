"""The engine in its own process, so the HTTP loop and the engine stop sharing one GIL.

In one process the engine thread gives the GIL up at every torch call and waits to win it back from
the asyncio loop that formats and writes the streams: with 256 streamed chats after an 8K-token
system prompt on an H200 the server reached 81-87% of the offline API's tokens/s, unstreamed 98-113%
(``benchmarks/probes/server_compare.py``). vLLM and SGLang run their engine cores apart for the same
reason. ``EngineProcess`` has ``EngineLoop``'s interface (the routes cannot tell them apart):

* the child (``_serve_engine``) owns the Engine and runs the same loop as the engine thread, reading
  commands from a pipe between steps and writing each step's outputs back;
* outputs cross as deltas (``OutputEncoder`` / ``OutputDecoder``): outputs are cumulative, and sending
  whole ones would copy every token again each step; the prompt's ids cross once;
* a reader thread in the server process decodes them and delivers them as the engine thread did
  (per-request queues, backpressure, latency metrics); ``run`` takes picklable callables only;
* the waiting queue's state (``QueueState``, for refusals at arrival in this process:
  ``overload.ArrivalGate``) rides with every step's outputs and every add's answer, so it is never
  older than the child's last step.

If the child dies, its requests end with finish_reason "error", /health answers 503 and nothing more
is accepted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Container
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

from prefixserve.config import EngineConfig
from prefixserve.engine.gc_tuning import GcPauses
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling.params import SamplingParams
from prefixserve.serving.admission import Admission, AdmissionLimits
from prefixserve.serving.engine_thread import (
    IDLE_WAIT_S,
    EngineLoop,
    EngineStopped,
    LatencyObserver,
    StreamSink,
    _resolve,
    _Stream,
    abort_everything,
    add_or_refuse,
    engine_metrics,
    name_os_thread,
    serve_step,
)
from prefixserve.serving.host_trim import IdleTrim

log = logging.getLogger(__name__)

T = TypeVar("T")

READY_TIMEOUT_S = 1800.0  # loading a large model and capturing its graphs
SNAPSHOT_EVERY_S = 0.1  # how often a busy child sends its metrics


def wants_engine_process(choice: str, config: EngineConfig) -> bool:
    """``--engine-process``: auto is on when the engine will run on a GPU (where the host is what the
    HTTP loop slows down); a CPU engine needs the cores more than a GIL of its own."""
    if choice != "auto":
        return choice == "on"
    if config.device == "auto":
        import torch

        return torch.cuda.is_available()
    return config.device.startswith("cuda")


# ---- outputs as deltas --------------------------------------------------------------------------
def _tail(sent: int, items: list[Any] | None) -> tuple[int, list[Any] | None]:
    """(how many of the ``sent`` items to keep, the items after them): lists here only grow."""
    if items is None:
        return 0, None
    if len(items) < sent:
        return 0, list(items)
    return sent, items[sent:]


class OutputEncoder:
    """The child's side: what each request's caller has already been sent, and the deltas."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, list[Any]]] = {}  # rid -> index -> [text, tokens, lps, tops]

    def encode(self, out: RequestOutput) -> tuple[Any, ...]:
        first = out.request_id not in self._sent
        per = self._sent.setdefault(out.request_id, {})
        choices = []
        for c in out.outputs:
            text, ntok, nlp, ntop = per.get(c.index) or ("", 0, 0, 0)
            keep = len(text) if c.text.startswith(text) else 0
            tok = _tail(ntok, c.token_ids)
            lp, top = _tail(nlp, c.token_logprobs), _tail(ntop, c.top_logprobs)
            choices.append((c.index, keep, c.text[keep:], tok, c.finish_reason, c.stop_reason, lp, top))
            per[c.index] = [c.text, len(c.token_ids), len(c.token_logprobs or ()), len(c.top_logprobs or ())]
        if out.finished:
            del self._sent[out.request_id]
        head = (out.prompt, out.stored_prompt_token_ids) if first else None
        if out.prompt_token_logprobs is not None and (
            first or out.finished
        ):  # whole, once the prompt is done
            lists = (out.prompt_token_logprobs, out.prompt_top_logprobs, out.prompt_logprob_ranks)
            head = (out.prompt, out.stored_prompt_token_ids, *lists)
        counts = (out.num_cached_tokens, out.num_recomputed_tokens, out.module_rows_shared)
        counts += (out.module_rows_private, out.error, out.embedding)
        counts += (out.cache_written_tokens, out.cache_pins_refused)
        return out.request_id, out.finished, head, choices, counts, out.metrics

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputDecoder:
    """The server's side: cumulative outputs rebuilt from the deltas (lists shared between a request's
    successive outputs: read them, do not modify them)."""

    def __init__(self) -> None:
        self._state: dict[str, tuple[Any, list[int], dict[int, list[Any]]]] = {}

    def decode(self, wire: tuple[Any, ...]) -> RequestOutput | None:
        """The output, or None for a request forgotten meanwhile (aborted here while it was sent)."""
        rid, finished, head, choices, counts, metrics = wire
        if head is not None:
            per = self._state[rid][2] if rid in self._state else {}
            self._state[rid] = (head[0], head[1], per, *head[2:])
        state = self._state.get(rid)
        if state is None:
            return None
        prompt, prompt_ids, per, *prompt_lp = state
        outputs = []
        for index, keep, text_add, tok, finish, stop, lp, top in choices:
            acc = per.setdefault(index, ["", [], None, None])
            acc[0] = acc[0][:keep] + text_add
            for slot, (kept, add) in ((1, tok), (2, lp), (3, top)):
                if add is None:
                    continue
                if acc[slot] is None or kept < len(acc[slot]):
                    acc[slot] = (acc[slot] or [])[:kept]
                acc[slot].extend(add)
            outputs.append(CompletionOutput(index, acc[0], acc[1], finish, stop, acc[2], acc[3]))
        if finished:
            self._state.pop(rid, None)
        cached, recomputed, shared, private, error, embedding, written, refused = counts
        lp, top, ranks = prompt_lp or (None, None, None)
        return RequestOutput(
            rid, prompt, prompt_ids, outputs, finished, cached, recomputed, shared, private, metrics,
            lp, top, error=error, prompt_logprob_ranks=ranks, embedding=embedding,
            cache_written_tokens=written, cache_pins_refused=refused,
        )  # fmt: skip

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def decode_live(self, wires: list[tuple[Any, ...]], live: Container[str]) -> list[RequestOutput]:
        """The outputs of the requests in ``live``; the others' wires are dropped and their state
        forgotten. A request aborted here unreported while its first output was on its way would
        otherwise get its state (its prompt's ids among it) rebuilt by that output's head, and no
        final output ever comes to clear it: one entry leaked per such abort."""
        outs = []
        for wire in wires:
            if wire[0] not in live:
                self._state.pop(wire[0], None)
                continue
            out = self.decode(wire)
            if out is not None:
                outs.append(out)
        return outs


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---- the child process ----------------------------------------------------------------------------
def _serve_engine(config: EngineConfig, conn: Any, limits: AdmissionLimits | None = None) -> None:
    """The child's main: load the engine, say so, then step and answer commands until told to stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    name_os_thread("ps-engine-proc")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    try:
        from prefixserve.engine import Engine

        engine = Engine(config, progress=False)
        started = time.perf_counter()
        if captured := engine.capture_graphs(progress=True, seal=True):
            log.info("captured %d graphs in %.1f s before serving", captured, time.perf_counter() - started)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    admission = None if limits is None else Admission(engine, limits)
    conn.send(
        (
            "ready",
            {
                "model": engine.model_name,
                "max_model_len": engine.max_model_len,
                "hidden_size": engine.model_config.hidden_size,
                "eos_ids": sorted(engine.eos_ids),
                "system_prompts": dict(engine.config.system_prompts),
                "snapshot": engine_metrics(engine, admission),
                "queue": None if admission is None else admission.state(),
            },
        )
    )
    _EngineChild(engine, conn, admission).run()


class _EngineChild:
    """The engine thread's loop with a pipe for its command queue and its deliveries."""

    def __init__(self, engine: Any, conn: Any, admission: Admission | None = None) -> None:
        self.engine, self.conn, self.admission = engine, conn, admission
        self.encoder = OutputEncoder()
        self.paced: dict[str, Any] = {}  # streamed requests with a reader that paces them -> Request
        self.trim = IdleTrim()  # freed heap back to the OS after a burst (serving/host_trim.py)
        self.gc = GcPauses()  # this process's GC passes, in its snapshots
        self.send_s = self.send_longest = 0.0  # time spent sending outputs (the server not reading)
        self.last_snapshot = 0.0

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        try:
            while True:
                if conn.poll(0 if engine.has_unfinished() else IDLE_WAIT_S):
                    while True:
                        if self._apply(conn.recv()):
                            self._shutdown()
                            return
                        if not conn.poll(0):
                            break
                    if not engine.has_unfinished():  # an abort changed the counters: send them
                        self._send_outputs([], self._due_snapshot(force=True))
                if engine.has_unfinished():
                    outputs, dead = serve_step(engine, self.admission)
                    if dead:  # the server stops taking work before its requests hear they failed
                        self.conn.send(("dying",))
                    # the counters ride with the outputs when they are due, and always with the
                    # last outputs of a burst: the server counts them before it answers
                    self._send_outputs(outputs, self._due_snapshot(force=not engine.has_unfinished()))
                    if dead:
                        return
                    self.trim.busy()
                    if not engine.has_unfinished():  # the burst's last outputs are sent
                        self.trim.idle()
        except (EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone
            log.info("the server closed the pipe; the engine stops")
            engine.shutdown()

    def _apply(self, command: tuple[Any, ...]) -> bool:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            if command[2]:  # reported: its final output goes to the server as any other
                self.engine.abort(command[1], report=True)
            else:
                self.paced.pop(command[1], None)
                self.encoder.forget(command[1])
                self.engine.abort(command[1], report=False)
        elif kind == "resume":
            for rid in command[1]:
                req = self.paced.get(rid)
                if req is not None:
                    req.stream = True
        elif kind == "abort_all":
            abort_everything(self.engine)
        elif kind == "call":
            _, call_id, fn = command
            try:
                result: tuple[Any, ...] = ("result", call_id, True, fn(self.engine))
            except Exception as exc:
                result = ("result", call_id, False, _portable(exc))
            # a caller that looks at /metrics next sees what came before
            self._send_outputs([], self._due_snapshot(force=True))
            try:
                self.conn.send(result)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                self.conn.send(("result", call_id, False, RuntimeError(f"unpicklable result: {exc}")))
        elif kind == "stop":
            return True
        return False

    def _add(
        self, rid: str, prompt: Any, params: SamplingParams, kwargs: dict[str, Any], paced: bool
    ) -> None:
        req, error = add_or_refuse(self.engine, rid, prompt, params, kwargs, self.admission)
        if error is None and paced:
            self.paced[rid] = req
        self.conn.send(("accepted", rid, None if error is None else _portable(error), self._queue_state()))

    def _queue_state(self) -> Any:
        """The waiting queue now (``QueueState``), or None without an admission."""
        return None if self.admission is None else self.admission.state()

    def _send_outputs(self, outputs: list[RequestOutput], snapshot: dict[str, float] | None = None) -> None:
        wires = []
        for out in outputs:
            req = self.paced.get(out.request_id)
            if out.finished:
                self.paced.pop(out.request_id, None)
            elif req is not None:
                req.stream = False  # no more outputs until the server's reader took this one
            wires.append(self.encoder.encode(out))
        state = self._queue_state()  # after every step: the queue as the step left it
        if wires or snapshot is not None or state is not None:
            began = time.perf_counter()
            self.conn.send(("out", wires, snapshot, state))  # waits while the server's reader lags
            took = time.perf_counter() - began
            self.send_s += took
            self.send_longest = max(self.send_longest, took)

    def _due_snapshot(self, force: bool = False) -> dict[str, float] | None:
        """The engine's counters, when ``force``d or SNAPSHOT_EVERY_S after the last ones sent."""
        now = time.monotonic()
        if not force and now - self.last_snapshot < SNAPSHOT_EVERY_S:
            return None
        self.last_snapshot = now
        pipe = {
            "engine_pipe_send_seconds_total": self.send_s,
            "engine_pipe_send_longest_seconds": self.send_longest,
        }
        return {**engine_metrics(self.engine, self.admission), **self.gc.metrics(), **pipe}

    def _shutdown(self) -> None:
        abort_everything(self.engine)
        self._send_outputs(self.engine.step(), self._due_snapshot(force=True))
        self.engine.shutdown()
        self.conn.send(("stopped",))


# ---- the server's side ----------------------------------------------------------------------------
class _RemoteRequest:
    """What ``StreamSink`` resumes: setting ``stream`` asks the child to send this request's outputs again."""

    __slots__ = ("owner", "request_id")

    def __init__(self, owner: EngineProcess, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id

    @property
    def stream(self) -> bool:
        return True

    @stream.setter
    def stream(self, value: bool) -> None:
        if value:
            self.owner._resume(self.request_id)


class EngineProcess(EngineLoop):
    """``EngineLoop``'s interface over an engine in a child process (spawned: CUDA starts there only)."""

    def __init__(
        self,
        config: EngineConfig,
        observer: LatencyObserver | None = None,
        limits: AdmissionLimits | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve_engine, args=(config, child, limits), name="prefixserve-engine"
        )
        self._process.start()
        child.close()
        if not self._conn.poll(READY_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError("the engine process did not start")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(
                f"the engine process exited ({self._process.exitcode}) while loading"
            ) from None
        if kind != "ready":
            self._process.join(30)
            raise RuntimeError(f"the engine could not start: {info}")
        self.info: dict[str, Any] = info
        self.engine = None  # type: ignore[assignment]
        self._init_delivery(
            observer, info["snapshot"], info.get("queue"), self._read, "prefixserve-engine-reader"
        )
        self._adds: dict[str, tuple[_Stream, asyncio.Future[None]]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._decoder = OutputDecoder()
        self._resumes: list[str] = []
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # pickled commands; None: stop
        self._write_failed = False
        self._writer = threading.Thread(target=self._write, name="prefixserve-engine-writer", daemon=True)
        self._writer.start()

    # ---- the asyncio side ----------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._put(("stop",))
        self._outbox.put(None)
        self._writer.join(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    @property
    def in_flight(self) -> int:
        return len(self._streams) + len(self._adds)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._process.is_alive() and not self._stopping

    @property
    def pid(self) -> int | None:
        """The engine process's id (a replica reports it; tests kill it)."""
        return self._process.pid

    def _refusal(self) -> str:
        return (
            "the server is shutting down" if self._process.is_alive() else "the engine process is not running"
        )

    def _queue_add(self, add: tuple[Any, ...]) -> bool:
        request_id, prompt, params, kwargs, stream, accepted = add
        paced = stream.stream and isinstance(stream.sink, StreamSink)  # StreamSink: its reader paces it
        self._adds[request_id] = (stream, accepted)
        if self._put(("add", request_id, prompt, params, kwargs, paced)):
            return True
        self._adds.pop(request_id, None)
        return False

    def abort(self, request_id: str, report: bool = False) -> None:
        if report:  # its final output still comes, as any other
            self._put(("abort", request_id, True))
            return
        self._adds.pop(request_id, None)  # an add cancelled before its answer: never registered
        self._streams.pop(request_id, None)
        self._decoder.forget(request_id)
        self._put(("abort", request_id, False))

    def abort_all(self) -> None:
        self._put(("abort_all",))

    def call(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` in the engine process between steps; ``fn`` and its result are pickled
        (a module-level function, ``functools.partial`` of one, ``operator.methodcaller``)."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = done
        try:
            sent = self._put(("call", call_id, fn))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self._calls.pop(call_id, None)
            done.set_exception(TypeError(f"the engine process cannot run {fn!r}: {exc}"))
            return done
        if not sent:
            self._calls.pop(call_id, None)
            done.set_exception(EngineStopped("the server is shutting down"))
        return done

    def _put(self, command: tuple[Any, ...]) -> bool:
        """Queue ``command`` for the writer thread (pickled here: an unpicklable one raises to the
        caller). The caller, the event loop among them, never waits on the pipe: a child busy in a
        long step or a GC pass reads nothing, the pipe's buffer fills after a few prompts, and a
        blocking send would stop every stream and every refusal at arrival until it reads again."""
        data = ForkingPickler.dumps(command)
        with self._lock:
            if self._closed or self._write_failed:
                return False
            self._outbox.put(data)
            return True

    def _write(self) -> None:
        """The writer thread: sends the queued commands in order until told to stop or the pipe breaks
        (the reader then sees the child gone and fails what is pending)."""
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the child is gone
                self._write_failed = True
                return

    def _resume(self, request_id: str) -> None:
        """Queue a resume; one message per loop turn carries all of them."""
        self._resumes.append(request_id)
        if len(self._resumes) == 1:
            asyncio.get_running_loop().call_soon(self._flush_resumes)

    def _flush_resumes(self) -> None:
        ids, self._resumes = self._resumes, []
        if ids:
            self._put(("resume", ids))

    # ---- the reader thread (EngineLoop.start starts it) ------------------------------------------
    def _read(self) -> None:
        name_os_thread("ps-engine-read")
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "out":
                    if message[2] is not None:  # counters first: they cover these outputs
                        self.snapshot = message[2]
                    if message[3] is not None:
                        self.queue_state = message[3]
                    # a request's "accepted" comes before its outputs: one not registered was aborted
                    self._deliver(self._decoder.decode_live(message[1], self._streams))
                elif kind == "dying":  # the engine lost a worker: not alive from now on
                    self._stopping = True
                elif kind == "accepted":
                    if message[3] is not None:  # the add decided: before its caller hears of it
                        self.queue_state = message[3]
                    self._accepted(message[1], message[2])
                elif kind == "result":
                    done = self._calls.pop(message[1], None)
                    if done is not None and done.set_running_or_notify_cancel():
                        if message[2]:
                            done.set_result(message[3])
                        else:
                            done.set_exception(message[3])
                elif kind == "stopped":
                    break
        except (EOFError, OSError):
            if not self._stopping:
                log.error(
                    "the engine process died (exit code %s); failing its requests", self._process.exitcode
                )
        finally:
            self._fail_everything()

    def _accepted(self, request_id: str, error: BaseException | None) -> None:
        stream, future = self._adds.pop(request_id, (None, None))
        if stream is None or future is None:
            return
        if error is None:
            stream.request = _RemoteRequest(self, request_id)
            stream.last_time = time.monotonic()
            self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_resolve, future, error)

    def _fail_everything(self) -> None:
        """The child is gone: end every stream with an error, fail what waits on it, take nothing more."""
        self._stopping = True
        with self._lock:
            self._closed = True
        stopped = EngineStopped("the engine process stopped")
        for stream, future in list(self._adds.values()):
            stream.loop.call_soon_threadsafe(_resolve, future, stopped)
        self._adds.clear()
        for done in list(self._calls.values()):
            if done.set_running_or_notify_cancel():
                done.set_exception(stopped)
        self._calls.clear()
        failed = [
            RequestOutput(rid, None, [], [CompletionOutput(0, "", [], "error")], True)
            for rid in list(self._streams)
        ]
        self._deliver(failed)


__all__ = ["EngineProcess", "OutputDecoder", "OutputEncoder", "wants_engine_process"]
