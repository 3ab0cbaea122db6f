"""Where a JSON-schema step's host time goes: xgrammar's mask fill per row, state by state.

The schema and workload are ``benchmarks/structured.py``'s (B rows, T tokens each). The rows' tokens
come from the default model on the CPU (``--walk model``: its greedy JSON-schema outputs) or from a
uniform pick among each step's allowed tokens (``--walk random``: what random weights do, whitespace
runs included). Each row's tokens are replayed through a matcher of the grammar as xgrammar builds
it (``raw``) and as ``GrammarCache`` compiles it (``folded``: bounded repeats folded,
``structured/repeats.py``), both ways of whitespace (free, ``compact``). Prints, per grammar:

- compile time; one row's fill per state kind (inside a string, after whitespace, elsewhere): mean
  and worst microseconds (masks checked equal between raw and folded at every step);
- the step's fill for all B rows (``batch_fill_next_token_bitmask``) at each ``--threads``: mean and
  worst milliseconds a step; creating B matchers; advancing B matchers by one token (a call a row,
  and one ``batch_accept_token`` call as ``StructuredDecoding`` makes it).

``--vocab 0 128256`` runs it once per tokenizer: 0 is the default model's (SmolLM2, 49,152 entries),
N a byte-level BPE of N entries (``benchmarks/harness/big_tokenizer.py``, Llama 3's layout; built
once, about a minute for 128K, then cached). The model walks are the default model's outputs: its
own ids, and for a BPE their text as the BPE encodes it (any tokenization of text the grammar accepts
is accepted), so every tokenizer walks the same JSON. A summary ends the run, per tokenizer and way
of whitespace (folded grammar): one row's fill over all states, the B-row fill a step and a row of
it, the accept a row (a call a row; batched).

``--gil S``: whether xgrammar drops the GIL in its batch fill and accept (``_gil``: a worker thread
loops the engine worker's job while the main thread counts in Python for S seconds, beside C calls
that hold and drop the GIL; the main thread's longest stall during one long call).

PYTHONPATH=. python -m benchmarks.probes.structured_fill [--walk model|random] [--batch 64] [--tokens 64]
    [--vocab 0 128256] [--gil 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.structured import SCHEMA


def _walks_model(batch: int, tokens: int, compact: bool) -> list[tuple[str, list[int]]]:
    """The default model's greedy JSON-schema outputs on the CPU (the benchmark's prompts): text, ids."""
    from benchmarks.structured import _conversations
    from prefixserve import LLM, SamplingParams, StructuredOutputs

    llm = LLM(dtype="float32", device="cpu", max_num_seqs=max(batch, 8), progress=False)
    spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=compact)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, structured_outputs=spec)
    outs = llm.chat(_conversations(batch), params)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


def _tokenizer(vocab: int, directory: str | None = None) -> tuple[Any, str]:
    """The default model's tokenizer (0; or the one in ``directory``) or a byte-level BPE of ``vocab``
    entries, and its label."""
    from pathlib import Path

    from prefixserve.model.loader import load_tokenizer

    if not vocab:
        tok = load_tokenizer(Path(directory) if directory else None)
        return tok, f"{directory or 'default model'}'s ({len(tok):,})"
    from benchmarks.harness.big_tokenizer import tokenizer_dir

    return load_tokenizer(tokenizer_dir(vocab)), f"BPE ({vocab:,})"


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].nonzero().view(-1).tolist()


def _walks_random(xgr: Any, compiled: Any, batch: int, tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    mask = xgr.allocate_token_bitmask(1, vocab)
    walks = []
    for _ in range(batch):
        m, walk = xgr.GrammarMatcher(compiled), []
        while len(walk) < tokens and not m.is_terminated():
            m.fill_next_token_bitmask(mask)
            walk.append(rng.choice(_allowed(mask[0], vocab)))
            m.accept_token(walk[-1])
        walks.append(walk)
    return walks


def _kind(text: str) -> str:
    """Which state a row is in after ``text``: inside a string, after whitespace, or elsewhere."""
    quotes = len(text) - len(text.replace('\\"', "").replace('"', "")) - text.count('\\"')
    if quotes % 2:
        return "string"
    return "whitespace" if text[-1:].isspace() else "structure"


def _per_row(
    xgr: Any, grammars: dict[str, Any], walks: list[list[int]], tok: Any, vocab: int
) -> dict[str, float]:
    times: dict[str, dict[str, list[float]]] = {g: defaultdict(list) for g in grammars}
    masks = {g: xgr.allocate_token_bitmask(1, vocab) for g in grammars}
    for walk in walks:
        matchers = {g: xgr.GrammarMatcher(c) for g, c in grammars.items()}
        for i, token in enumerate(walk):
            kind = _kind(tok.decode(walk[:i])) if i else "structure"
            for g, m in matchers.items():
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(masks[g])
                times[g][kind].append(time.perf_counter() - t0)
                m.accept_token(token)
            first = next(iter(masks.values()))
            assert all(torch.equal(first, m) for m in masks.values()), "grammars disagree"
    print("one row's fill (us): state | visits | " + " | ".join(f"{g} mean / worst" for g in grammars))
    for kind in ("structure", "whitespace", "string"):
        n = len(times[next(iter(grammars))][kind])
        if n:
            cells = [
                f"{sum(v) / n * 1e6:8.1f} / {max(v) * 1e6:8.1f}" for v in (times[g][kind] for g in grammars)
            ]
            print(f"  {kind:10s} | {n:5d} | " + " | ".join(cells))
    return {g: sum(sum(v) for v in t.values()) / sum(len(v) for v in t.values()) for g, t in times.items()}


def _per_step(
    xgr: Any, grammars: dict[str, Any], walks: list[list[int]], vocab: int, threads: list[int]
) -> dict[str, dict[str, float]]:
    """Per grammar: the B-row fill a step (first thread count), its rows, and the accept a row (a call a
    row; one batched call), seconds."""
    from prefixserve.structured.matcher_process import _batch_accept

    accept = _batch_accept(xgr)  # one call, as the engine makes it (xgrammar's wrapper: a call a row more)
    rows, steps = len(walks), max(len(w) for w in walks)
    mask = xgr.allocate_token_bitmask(rows, vocab)
    out = {}
    for g, compiled in grammars.items():
        t0 = time.perf_counter()
        created = [xgr.GrammarMatcher(compiled) for _ in walks]
        made = time.perf_counter() - t0
        cells = []
        for n in threads:
            batch = xgr.BatchGrammarMatcher(max_threads=n)
            matchers = [xgr.GrammarMatcher(compiled) for _ in walks]
            batched = [xgr.GrammarMatcher(compiled) for _ in walks]
            fills, accepts, batch_accepts, live_rows = [], [], [], 0
            for step in range(steps):
                live = [i for i, w in enumerate(walks) if step < len(w)]
                live_rows += len(live)
                t0 = time.perf_counter()
                batch.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, live)
                fills.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in live:
                    matchers[i].accept_token(walks[i][step])
                accepts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                accept([batched[i] for i in live], [walks[i][step] for i in live])
                batch_accepts.append(time.perf_counter() - t0)
            cells.append(f"{n} threads {sum(fills) / steps * 1e3:6.2f} / {max(fills) * 1e3:6.2f}")
            if n == threads[0]:
                out[g] = {
                    "fill_step": sum(fills) / steps,
                    "fill_row": sum(fills) / live_rows,
                    "accept_row": sum(accepts) / live_rows,
                    "batch_accept_row": sum(batch_accepts) / live_rows,
                }
        print(
            f"  {g:15s} | fill ms mean / worst: " + " | ".join(cells)
            + f" | {rows} matchers made {made * 1e3:.2f} ms | advanced {sum(accepts) / steps * 1e3:.2f} ms"
            + f" (batched {sum(batch_accepts) / steps * 1e3:.2f} ms)"
        )  # fmt: skip
        del created
    return out


def _calibrated(fn: Any, seconds: float) -> int:
    """The size n at which ``fn(n)`` takes about ``seconds``."""
    n = 1024
    while True:
        t0 = time.perf_counter()
        fn(n)
        took = time.perf_counter() - t0
        if took > 0.02 or n > 1 << 34:
            return max(1, int(n * seconds / took))
        n *= 4


def _count(seconds: float) -> tuple[int, float]:
    """Pure-Python counting for ``seconds``: the count, and the longest stall between two chunks."""
    n, stall, last = 0, 0.0, time.perf_counter()
    end = last + seconds
    while last < end:
        for _ in range(200):
            n += 1
        now = time.perf_counter()
        stall, last = max(stall, now - last), now
    return n, stall


def _stall_during(fn: Any) -> tuple[float, float]:
    """``fn`` run once on a thread while this one counts: its time, and this thread's longest stall."""
    import threading

    took, done = [0.0], threading.Event()

    def run() -> None:
        t0 = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - t0
        done.set()

    worker = threading.Thread(target=run)
    stall, last = 0.0, time.perf_counter()
    worker.start()  # (start waits for the thread to run: a call that holds the GIL stalls it already)
    while not done.is_set():
        for _ in range(200):
            pass
        now = time.perf_counter()
        stall, last = max(stall, now - last), now
    worker.join()
    return took[0], max(stall, time.perf_counter() - last)


def _gil(xgr: Any, compiled: Any, walks: list[list[int]], tok: Any, seconds: float) -> None:
    """Does xgrammar drop the GIL in ``batch_fill_next_token_bitmask`` and ``batch_accept_token``, and
    what does the engine's worker job cost beside a thread busy in Python?

    1. A worker thread loops one call on the B rows (along the walks) while the main thread counts in
       pure Python for ``seconds``: the main thread's count against its count alone, its longest
       stall, the worker's calls a second; beside two controls of the fill's length, a C call that
       holds the GIL (``sum(range(n))``) and one that drops it (``hashlib.sha256``, busy on a core).
    2. The engine worker's job (accept the step's tokens, fill the next mask), alone and beside a
       thread busy in Python, at the interpreter's switch interval and at the server's 0.5 ms: as
       ``StructuredDecoding`` runs it (two calls into xgrammar a step) and with a call a row (each
       matcher's ``is_terminated`` before the accept and the fill, and xgrammar's ``batch_accept_token``
       wrapper, which reads its answers back a call a row), as it ran before.
    3. One long call (64 x B rows) on a thread: the main thread's longest stall meanwhile, beside a C
       call of the same length that holds the GIL.
    """
    import hashlib
    import sys
    import threading

    from prefixserve.structured.grammars import GrammarCache
    from prefixserve.structured.matcher_process import Matchers

    rows, steps, vocab = len(walks), max(map(len, walks)), len(tok)
    info = GrammarCache(tok, vocab, [tok.eos_token_id]).info.serialize_json()
    sd = Matchers(info, vocab, threads=1)  # what the matcher process holds
    one = sd.fills.one  # the one-thread batch matcher
    mask = xgr.allocate_token_bitmask(rows, vocab)
    at: dict[str, Any] = {"step": 0, "matchers": []}

    def advance() -> tuple[list[Any], int, list[int]]:
        """The matchers, the step, its live rows: a fresh walk after the last step."""
        j = at["step"]
        if j == 0:
            at["matchers"] = [sd._matcher_cls(compiled) for _ in walks]
        at["step"] = (j + 1) % steps
        return at["matchers"], j, [i for i, w in enumerate(walks) if j < len(w)]

    def fill() -> None:  # with the accept (one call) that moves the matchers along the walks
        ms, j, live = advance()
        one.batch_fill_next_token_bitmask([ms[i] for i in live], mask, live)
        sd._accept([ms[i] for i in live], [walks[i][j] for i in live])

    def accept_wrapper() -> None:
        ms, j, live = advance()
        xgr.BatchGrammarMatcher.batch_accept_token([ms[i] for i in live], [walks[i][j] for i in live])

    def job_now() -> None:
        ms, j, live = advance()
        sd.accept([ms[i] for i in live], [walks[i][j] for i in live])
        going = [i for i in live if not ms[i].ended]
        one.batch_fill_next_token_bitmask([ms[i] for i in going], mask, going)

    def job_before() -> None:
        ms, j, live = advance()
        going = [i for i in live if not ms[i].is_terminated()]
        xgr.BatchGrammarMatcher.batch_accept_token([ms[i] for i in going], [walks[i][j] for i in going])
        going = [i for i in live if not ms[i].is_terminated()]
        one.batch_fill_next_token_bitmask([ms[i] for i in going], mask, going)

    def alone(fn: Any) -> float:
        at["step"] = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) / steps

    fill_s = alone(fill)
    held_n = _calibrated(lambda n: sum(range(n)), fill_s)
    data = bytes(_calibrated(lambda n: hashlib.sha256(bytes(n)).digest(), fill_s))
    workers = {
        "fill + accept, a call each": fill,
        "accept, xgrammar's wrapper": accept_wrapper,
        "control: C call holding the GIL": lambda: sum(range(held_n)),
        "control: C call dropping it": lambda: hashlib.sha256(data).digest(),
    }
    base, base_stall = _count(seconds)
    print(
        f"\nGIL 1: a worker loops a call while the main thread counts in Python for {seconds:.0f} s (alone "
        f"{base / seconds / 1e6:.1f} M/s, longest stall {base_stall * 1e3:.2f} ms), switch interval "
        f"{sys.getswitchinterval() * 1e3:.1f} ms, {rows} rows"
    )
    for name, fn in workers.items():
        one = alone(fn)
        at["step"] = 0
        stop, calls = threading.Event(), [0]

        def loop(fn: Any = fn, stop: threading.Event = stop, calls: list[int] = calls) -> None:
            while not stop.is_set():
                fn()
                calls[0] += 1

        worker = threading.Thread(target=loop)
        worker.start()
        n, stall = _count(seconds)
        stop.set()
        worker.join()
        print(
            f"  {name:32s} | {one * 1e3:5.2f} ms a call alone | main thread {n / base:5.3f} of alone, "
            f"longest stall {stall * 1e3:6.2f} ms | worker {calls[0] / seconds:6.0f} calls/s"
        )
    print("GIL 2: the engine worker's job (accept, fill), ms a step: median / worst over the walks")
    interval = sys.getswitchinterval()
    for switch in sorted({interval, 0.0005}, reverse=True):
        sys.setswitchinterval(switch)
        for busy in (False, True):
            spin = [busy]

            def spinner(spin: list[bool] = spin) -> None:
                x = 0
                while spin[0]:
                    for _ in range(100):
                        x += 1

            thread = threading.Thread(target=spinner)
            thread.start()
            time.sleep(0.05)
            cells = []
            for job in (job_now, job_before):
                at["step"], times = 0, []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    job()
                    times.append(time.perf_counter() - t0)
                cells.append(f"{statistics.median(times) * 1e3:7.3f} / {max(times) * 1e3:7.3f}")
            spin[0] = False
            thread.join()
            where = "beside a thread busy in Python" if busy else "alone"
            print(
                f"  switch {switch * 1e3:3.1f} ms, {where:30s} | two calls a step {cells[0]} | "
                f"a call a row {cells[1]}"
            )
    sys.setswitchinterval(interval)
    many = [xgr.GrammarMatcher(compiled) for _ in range(64 * rows)]
    big = xgr.allocate_token_bitmask(len(many), vocab)
    firsts = [walks[i % rows][0] for i in range(len(many))]
    long_calls = {
        "batch_fill_next_token_bitmask": lambda: one.batch_fill_next_token_bitmask(many, big),
        "batch_accept_token (one call)": lambda: sd._accept(many, firsts),
    }
    print(f"GIL 3: one long call ({len(many)} rows) on a thread; the main thread's longest stall meanwhile")
    for name, fn in long_calls.items():
        took, stall = _stall_during(fn)
        n = _calibrated(lambda n: sum(range(n)), took)
        held, held_stall = _stall_during(lambda n=n: sum(range(n)))
        print(
            f"  {name:30s} {took * 1e3:7.1f} ms: stall {stall * 1e3:6.2f} ms (a C call of "
            f"{held * 1e3:.1f} ms holding the GIL: {held_stall * 1e3:6.2f} ms)"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--walk", default="model", choices=["model", "random"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--vocab", type=int, nargs="+", default=[0], help="tokenizers: 0 the default model's, N a BPE of N"
    )
    ap.add_argument(
        "--tokenizer", default=None, help="a tokenizer's directory in place of the default model's"
    )
    ap.add_argument(
        "--gil", type=float, default=0.0, help="seconds a GIL run (free whitespace, folded; 0: none)"
    )
    args = ap.parse_args(argv)
    import xgrammar as xgr

    from prefixserve.structured.grammars import MAX_WHITESPACE, folded

    texts: dict[bool, list[tuple[str, list[int]]]] = {}
    summary = []
    for size in args.vocab:
        tok, label = _tokenizer(size, args.tokenizer)
        vocab = len(tok)
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
        info_s = time.perf_counter() - t0
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        print(f"\n#### tokenizer: {label}, xgrammar's TokenizerInfo built in {info_s:.2f} s")
        for compact in (False, True):
            ws: dict[str, Any] = (
                {"any_whitespace": False} if compact else {"max_whitespace_cnt": MAX_WHITESPACE}
            )
            grammar = xgr.Grammar.from_json_schema(json.dumps(SCHEMA), strict_mode=True, **ws)
            grammars, line = {}, []
            for name, g in (("raw", grammar), ("folded", folded(grammar))):
                t0 = time.perf_counter()
                grammars[name] = compiler.compile_grammar(g)
                line.append(f"{name} compiled in {(time.perf_counter() - t0) * 1e3:.0f} ms")
            if args.walk == "model":
                if compact not in texts:
                    texts[compact] = _walks_model(args.batch, args.tokens, compact)
                # the default tokenizer walks the model's own ids, another the same text as it encodes it
                walks = [
                    ids if not size else tok.encode(t, add_special_tokens=False) for t, ids in texts[compact]
                ]
            else:
                walks = _walks_random(xgr, grammars["folded"], args.batch, args.tokens, vocab)
            kind = "compact" if compact else "free whitespace"
            print(f"\n== {kind} ({args.walk} walk, {len(walks)} rows x {max(map(len, walks))} tokens): "
                  + ", ".join(line))  # fmt: skip
            row = _per_row(xgr, grammars, walks, tok, vocab)
            print(f"{len(walks)} rows a step:")
            step = _per_step(xgr, grammars, walks, vocab, args.threads)
            summary.append((label, "compact" if compact else "free", row["folded"], step["folded"]))
            if args.gil and not compact:
                _gil(xgr, grammars["folded"], walks, tok, args.gil)
    print(
        f"\nsummary (folded grammar, {args.walk} walk, fill on {args.threads[0]} thread(s)): tokenizer | "
        "whitespace | one row's fill, us | B-row fill a step, ms (a row, us) | accept a row, us (batched)"
    )
    for label, ws_kind, row_s, st in summary:
        accept = f"{st['accept_row'] * 1e6:6.2f} ({st['batch_accept_row'] * 1e6:5.2f})"
        print(
            f"  {label:24s} | {ws_kind:7s} | {row_s * 1e6:7.1f} | {st['fill_step'] * 1e3:6.2f} "
            f"({st['fill_row'] * 1e6:6.1f}) | {accept}"
        )


if __name__ == "__main__":
    main()
