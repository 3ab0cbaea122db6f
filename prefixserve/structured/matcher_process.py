"""The grammar matchers in a process of their own: each step's accept and mask fill off the engine's GIL.

xgrammar drops the GIL inside each call, but a thread that called it must take the GIL back between
calls, and the engine's thread holds it while it runs Python: beside an engine thread busy assembling
steps, a worker thread's two calls a step waited for the GIL longer than they ran (a small model's
step is mostly host work). So every matcher lives in a child process (``serve``) that owns its GIL:
the engine's process sends a step's accepted tokens and the rows to fill, one small message, and goes
on; the child accepts, fills the rows straight into the step's host slot (an anonymous shared-memory
file whose descriptor it was sent, ``bitmask.SharedSlots``) and answers with the rows it filled.
Nothing of the mask crosses the socket.

The engine's side (``MatcherProcess``) names each matcher by an integer key; a matcher is made in the
child when its key is first sent with its spec, and dropped when the engine's handle to it
(``MatcherHandle``, in the request's rule state) is collected. The child compiles each spec it is
sent (``GrammarCache``, the same rules as the engine's own, which checks specs at intake) on a thread
of its own: the spec is sent at intake, so the compile overlaps the prefill, and the steps of other
requests are answered meanwhile. Messages keep their order: at most one step's answer is awaited at
a time, and an error of a step with no answer waiting is reported with the next.

The child is started with ``subprocess`` (``python -m prefixserve.structured.matcher_process FD``),
not ``multiprocessing``: a spawned child would run the user's main module again, which breaks a
script that makes an ``LLM`` at its top level. It exits when its end of the socket closes.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any, NoReturn

import torch

from prefixserve.sampling.structured_outputs import StructuredOutputs

_KEYS = itertools.count(1)
log = logging.getLogger(__name__)


class MatcherHandle:
    """The engine's name for one sequence's matcher; collecting it drops the matcher in the child."""

    __slots__ = ("__weakref__", "key")

    def __init__(self, key: int) -> None:
        self.key = key


class MatcherProcess:
    """The engine's end: starts the child, sends it specs and steps, reads each step's filled rows.

    A child that dies or does not answer within ``ANSWER_SECONDS`` fails the step waiting on it (its
    requests end with an error) and is replaced at the next message: requests whose matchers it held
    fail at their next step, later ones are served by the new child."""

    ANSWER_SECONDS = 60.0

    def __init__(self) -> None:
        """Start the child: it imports xgrammar (seconds: torch and transformers with it) and waits for
        ``setup``; a GPU engine starts it with the engine (``rule.py``), so its first constrained
        request does not wait for that."""
        self._sending = threading.Lock()  # specs come from the intake's thread, steps from the engine's
        self._made: list[tuple[int, StructuredOutputs]] = []  # matchers to make before the next step
        self._dropped: deque[int] = deque()  # keys of collected handles (their finalizers, any thread)
        self._setup: tuple[Any, ...] | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the child imports this copy of prefixserve
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._child = subprocess.Popen(
            [sys.executable, "-m", "prefixserve.structured.matcher_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # a terminal's Ctrl-C is the engine's to handle, not the child's
        )  # fmt: skip
        theirs.close()
        self._conn: Connection | None = Connection(ours.detach())
        self.close = weakref.finalize(self, _end, self._conn, self._child)  # also when collected
        self._awaited = False  # a step's answer is due
        self._slots: Any = None  # the host slots the child was last sent
        self._rows: list[tuple[int, int]] | None = None  # the (row, key)s of the last fill it was sent
        # slot -> (slots, number) of the last gated fill sent to this child: a device may wait for
        # it, so a child that ends (or is ended) releases it with ``-number`` (``release_waits``)
        self._gated: dict[int, tuple[Any, int]] = {}
        threading.Thread(
            target=_watch, args=(self._child, self._gated), daemon=True, name="prefixserve-matchers-watch"
        ).start()
        if self._setup is not None:  # a replacement: the set-up again (keys of the last one are unknown)
            self._conn.send(self._setup)  # (inside ``_send``'s lock)

    def setup(self, tokenizer_info_json: str, vocab_size: int, threads: int) -> None:
        """The tokenizer (xgrammar's ``TokenizerInfo``, serialized), the vocabulary, the fill's threads."""
        self._setup = ("setup", tokenizer_info_json, vocab_size, threads)
        self._send(self._setup)

    def compile(self, spec: StructuredOutputs) -> None:
        """Have the child compile ``spec`` now, beside its steps (no answer): a matcher made of it
        later waits for that compile only if it has not ended."""
        self._send(("spec", spec))

    def matcher(self, spec: StructuredOutputs) -> MatcherHandle:
        """A new matcher of ``spec``, made in the child with the next step."""
        handle = MatcherHandle(next(_KEYS))
        self._made.append((handle.key, spec))
        weakref.finalize(handle, self._dropped.append, handle.key)
        return handle

    def step(
        self,
        accepts: tuple[list[int], list[int]],
        fill: tuple[Any, int, int, list[tuple[int, int]]] | None,
        number: int | None = None,
    ) -> None:
        """Send a step: ``accepts`` (keys, tokens) taken in order, then with ``fill`` = (slots, slot,
        rows n, [(row, key)]) those rows of ``slots[slot][:n]`` filled (the child gets them as the job
        (slots' shape or None, slot, n, rows, number)); its answer is ``rows()``.
        With ``number`` the fill is gated (``gate.py``): no answer; the child fills the slot's other
        rows of the n with every token allowed and then writes ``number`` to the slot's flag
        (``-number`` if the step failed)."""
        self._answer()  # the last answer first: one at a time
        made, self._made = self._made, []
        dropped = [self._dropped.popleft() for _ in range(len(self._dropped))]
        slots = job = None
        if fill is not None:
            fresh = self._conn is None  # a replacement is sent the slots and the rows anew
            slots = fill[0] if fresh or fill[0] is not self._slots else None
            held, self._rows = (None if fresh else self._rows), None  # unknown until the message is out
            rows = None if fill[3] is held or fill[3] == held else fill[3]  # None: the last fill's
            job = (None if slots is None else slots.describe(), fill[1], fill[2], rows, number)
        if number is not None:
            self._gated[fill[1]] = (fill[0], number)
        self._send(("step", made, dropped, accepts, job), slots)
        if fill is not None:
            self._rows = fill[3]
        if slots is not None:
            self._slots = slots
        self._awaited = job is not None and number is None

    def lose(self, why: str) -> None:
        """End a child that failed a gated fill in time (hung or dead): killed, its device waits
        released, replaced at the next message."""
        log.warning("structured decoding's matcher process %s; it is restarted", why)
        self._child.kill()
        self._drop()

    def release_waits(self) -> None:
        """Release a device waiting for a gated fill this child will not write (``release_waits``)."""
        release_waits(self._gated)

    def _drop(self) -> None:
        """End the child; its gated fills released; a new one is started at the next message."""
        self.close()
        release_waits(self._gated)
        self._conn, self._awaited, self._slots = None, False, None

    def rows(self) -> list[int]:
        """The rows the last step's fill filled (matchers that ended are left out)."""
        if not self._awaited:
            raise RuntimeError("no step's fill was sent")
        return self._answer()

    def _answer(self) -> list[int]:
        if not self._awaited:
            return []
        self._awaited = False
        try:
            if not self._conn.poll(self.ANSWER_SECONDS):
                self._lose(f"no answer in {self.ANSWER_SECONDS:.0f} s")
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._lose(f"exited ({self._child.poll()})")
        if kind == "error":
            raise RuntimeError(f"structured decoding failed in its matcher process: {value}")
        return value

    def _send(self, message: tuple[Any, ...], slots: Any = None) -> None:
        """Send ``message`` (with ``slots``' file descriptor after it); a child lost before is replaced."""
        with self._sending:
            if self._conn is None:
                self._start()
            try:
                # plain pickle (the child's ``recv`` is ``pickle.loads``): ``Connection.send``'s
                # pickler copies its reducer table each call, a share of a constrained step's send
                self._conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
                if slots is not None:
                    send_handle(self._conn, slots.fd, self._child.pid)
            except OSError:
                self._lose(f"exited ({self._child.poll()})")

    def _lose(self, why: str) -> NoReturn:
        """End the child (replaced at the next message) and fail the step that met it."""
        self._drop()
        raise RuntimeError(f"structured decoding's matcher process {why}; it is restarted")


def release_waits(gated: dict[int, tuple[Any, int]]) -> None:
    """Write ``-number`` to each slot whose last gated fill's flag is not written: a device waiting for
    it goes on at once, and the step fails (``gate.FillGate.check``) instead of waiting out its bound."""
    for slot, (slots, number) in list(gated.items()):
        if int(slots.flags[slot]) != number:
            slots.flags[slot] = -number


def _watch(child: subprocess.Popen, gated: dict[int, tuple[Any, int]]) -> None:
    """When the child ends, for whatever reason, release the gated fills it held (its own dict: a
    replacement's fills are another's)."""
    child.wait()
    release_waits(gated)


def _end(conn: Connection, child: subprocess.Popen) -> None:
    """End the child (it exits when the socket closes; killed if it does not) and wait for it."""
    conn.close()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _matcher_class(xgr: Any) -> Any:
    """xgrammar's ``GrammarMatcher`` that keeps whether it ended (asking xgrammar is a call a row)."""

    class Matcher(xgr.GrammarMatcher):
        ended = False  # set by ``Matchers.accept`` once ``is_terminated`` says so

    return Matcher


def _batch_accept(xgr: Any) -> Any:
    """``batch_accept_token`` as one call into xgrammar: its Python wrapper reads the answers back a
    call a row, and they are not needed here; xgrammar's own wrapper where its internals differ."""
    core = getattr(getattr(xgr, "matcher", None), "_core", None)
    raw = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if raw is None:
        return xgr.BatchGrammarMatcher.batch_accept_token

    def accept(matchers: list[Any], tokens: list[int]) -> None:
        raw([m._handle for m in matchers], tokens, False)

    return accept


class FillThreads:
    """Which of xgrammar's batch matchers fills a step's mask: one thread, or up to ``MAX_THREADS``.

    One row's fill takes ~2-4 us in most grammar states (SmolLM2's 49K entries and a 128K BPE alike,
    bounded repeats folded: ``repeats``), so a 64-row step is ~0.1-0.25 ms on one thread, and there
    xgrammar's threads cost more than they save: on an H200's 16-core host
    (``benchmarks/probes/structured_fill.py --walk random --threads 1 2 4 8``, SmolLM2's tokenizer,
    folded JSON schema) 64 rows took 0.11 ms on one thread against 0.27 / 0.28 / 0.40 on 2 / 4 / 8,
    and 256 rows 0.87 against 0.80 / 0.68 / 1.05. But rows inside a run of free whitespace or a
    bounded string cost 20-70 us each, and a batch whose rows sit there together (a batch of similar
    requests) fills in 1-3.5 ms on one thread, longer than the engine's step that hides it. Such
    states last several tokens, so the fill is timed: a step whose fill was slow (``SLOW_SECONDS``,
    on either path) sends the next one to the threads, and a fill past ``FANOUT_ROWS`` rows always
    goes there. Cutting a step's rows into chunks on Python threads made the child's step slower
    (the engine thread's wait for a 64-row step 0.11 -> 0.35 ms: the threads take this process's GIL
    in turn)."""

    MAX_THREADS = 4
    FANOUT_ROWS = 128  # a step filling more rows than this goes to xgrammar's threads
    SLOW_SECONDS = 4e-4  # a fill that took longer than this: the next goes to the threads

    def __init__(self, xgr: Any, threads: int) -> None:
        self.one = xgr.BatchGrammarMatcher(max_threads=1)
        threads = min(threads, self.MAX_THREADS)
        self.many = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else self.one
        self.slow = False  # the last fill took longer than ``SLOW_SECONDS``

    def fill(self, matchers: list[Any], mask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``rows`` of ``mask`` from ``matchers`` (one a row), on one thread or many."""
        batch = self.many if self.slow or len(rows) > self.FANOUT_ROWS else self.one
        started = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        self.slow = time.perf_counter() - started > self.SLOW_SECONDS


class Matchers:
    """The child's state: the grammar cache, the matchers by key, the slots a step fills."""

    def __init__(self, tokenizer_info_json: str, vocab_size: int, threads: int) -> None:
        import xgrammar as xgr

        from prefixserve.structured.grammars import GrammarCache

        info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        self.grammars = GrammarCache(info, vocab_size, threads=max(2, threads))
        self.fills = FillThreads(xgr, threads)
        self.by_key: dict[int, Any] = {}
        self.slots: torch.Tensor | None = None
        self.rows: list[tuple[int, int]] = []  # the last fill's (row, key)s: a job's None repeats them
        self.flags: torch.Tensor | None = None  # each slot's fill flag (``SharedSlots.flags``)
        self._compiling: dict[tuple, Future] = {}  # specs compiled on a thread, beside the steps
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="prefixserve-compile")
        self._matcher_cls = _matcher_class(xgr)
        self._accept = _batch_accept(xgr)
        self._stops = frozenset(info.stop_token_ids)

    def compile(self, spec: StructuredOutputs) -> None:
        """Start compiling ``spec`` on the compile thread (the steps go on), unless it is cached."""
        key = spec.key()
        if key not in self._compiling and self.grammars.cached(spec) is None:
            self._compiling[key] = self._compiler.submit(self.grammars.compile, spec)

    def grammar(self, spec: StructuredOutputs) -> Any:
        """``spec``'s compiled grammar: cached, its compile on the thread waited for, or compiled now."""
        future = self._compiling.pop(spec.key(), None)
        if future is not None:
            return self.grammars.put(spec, future.result())
        return self.grammars.get(spec)

    def step(self, made: list, dropped: list[int], accepts: tuple, job: tuple | None) -> list[int] | None:
        """Make and drop matchers, take the accepted tokens; with ``job`` = (slots, slot, n, [(row,
        key)] or None for the last job's, number) also fill those rows of ``slots[slot][:n]``: the rows
        filled (ended matchers left out); a gated job (``number``) also sets the n rows' others to allow
        every token.
        A key this process does not hold (a replaced process's) fails the step after the others took
        their tokens."""
        if job is not None and job[3] is not None:  # first: the engine counts them sent whatever fails
            self.rows = job[3]
        for key, spec in made:  # made before dropped: a key in both (a request failed at once) goes
            self.by_key[key] = self._matcher_cls(self.grammar(spec))
        for key in dropped:
            self.by_key.pop(key, None)
        held = [(self.by_key.get(k), t) for k, t in zip(*accepts, strict=True)]
        self.accept([m for m, _ in held if m is not None], [t for m, t in held if m is not None])
        unknown = [k for (m, _), k in zip(held, accepts[0], strict=True) if m is None]
        filled = [(row, key, self.by_key.get(key)) for row, key in self.rows] if job is not None else []
        unknown += [key for _, key, m in filled if m is None]
        if unknown:
            raise KeyError(f"matchers {unknown[:8]} are not held here")
        if job is None:
            return None
        _, slot, n, _, number = job
        live = [(row, m) for row, _, m in filled if not m.ended]
        if live:
            self.fills.fill([m for _, m in live], self.slots[slot][:n], [row for row, _ in live])
        if number is not None:  # gated: the device masks all n rows, so the others allow every token
            others = sorted(set(range(n)).difference(row for row, _ in live))
            if others:
                self.slots[slot][others] = -1
        return [row for row, _ in live]

    def release(self, job: tuple | None, failed: bool) -> None:
        """A gated fill's flag: its number once its rows are written (``-number``: the step failed).
        x86 makes stores visible in program order, so the rows are there when the flag is; gating is
        on only on x86 hosts (``decoding.py``: Python has no store barrier for the others)."""
        if job is None or job[4] is None or self.flags is None:
            return
        self.flags[job[1]] = -job[4] if failed else job[4]

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        """Matchers that have not ended take their tokens (one call); one that took a stop token is
        asked whether it ended (the only call a row, once in a sequence's life)."""
        live = [k for k, m in enumerate(matchers) if not m.ended]
        if not live:
            return
        self._accept([matchers[k] for k in live], [tokens[k] for k in live])
        for k in live:
            if tokens[k] in self._stops and matchers[k].is_terminated():
                matchers[k].ended = True


def serve(conn: Connection) -> None:
    """The child's loop: a step with a fill is answered ("rows", filled rows) or ("error", why); a
    gated fill is answered by its flag alone (an error of a step before it fails it)."""
    from prefixserve.structured.bitmask import SharedSlots

    # xgrammar (seconds: torch and transformers with it) imported on a thread from the start, while this
    # one reads the set-up at once: the engine's send of it (megabytes) never waits for the import
    importer = threading.Thread(target=importlib.import_module, args=("xgrammar",), daemon=True)
    importer.start()
    try:
        _, info, vocab_size, threads = conn.recv()
    except (EOFError, OSError):  # started ahead, never used
        return
    importer.join()
    matchers = Matchers(info, vocab_size, threads)
    failed: str | None = None  # an error of a step with no answer due: reported with the next answer
    while True:
        try:
            message = conn.recv()
            if message[0] == "step" and message[4] is not None and message[4][0] is not None:
                slots = SharedSlots.open(recv_handle(conn), *message[4][0])  # the fd follows
                matchers.slots, matchers.flags = slots
        except (EOFError, OSError):  # the engine's end closed
            return
        if message[0] == "spec":  # checked at intake; an error here comes back when a matcher is made
            matchers.compile(message[1])
            continue
        job = message[4]
        gated = job is not None and job[4] is not None
        try:
            rows = matchers.step(*message[1:])
            if gated and failed:  # an earlier step's accepts failed: this fill's matchers may be off
                raise RuntimeError(failed)
            matchers.release(job, failed=False)
        except Exception as exc:  # the step's requests fail, the engine goes on
            failed = failed or f"{type(exc).__name__}: {exc}"
            if gated:  # no answer carries it: the flag says it, the log says why
                print(f"prefixserve matcher process: {failed}", file=sys.stderr, flush=True)
                matchers.release(job, failed=True)
                failed = None
        answer = job is not None and not gated
        if answer:
            try:
                conn.send(("error", failed) if failed else ("rows", rows))
            except OSError:
                return
            failed = None


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
