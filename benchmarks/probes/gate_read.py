"""Host time of a gated grammar step's mask, piece by piece (``structured/gate.py``), on a GPU.

A constrained decode step on a small model is host work end to end, so each microsecond of the
engine thread's time in the mask's launches is a microsecond of the step. With the fill's flag set
before each call (the device never waits), this times on the host, per call (median of ``--calls``):
the whole read (``StepBitmasks.read``), the gate's launch of both kernels (``FillGate.apply``), the
wait kernel and the mask kernel apart, the views and the event record they take, the greedy argmax
that follows (two launches), and the one launch (and its pick) that does all three for greedy rows
(``StepBitmasks.choose``, ``FillGate.argmax``).

PYTHONPATH=. python -m benchmarks.probes.gate_read [--rows 64] [--vocab 49152] [--calls 3000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness.output import write_json


def _median_us(fn: Callable[[], object], calls: int) -> float:
    """Median host time of ``fn`` in microseconds; the device drained every 100 calls."""
    times = []
    for i in range(calls):
        if i % 100 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)

    from prefixserve.sampling.argmax import argmax_rows
    from prefixserve.sampling.token_mask import kernel_token_mask
    from prefixserve.structured.bitmask import StepBitmasks
    from prefixserve.structured.gate import FillGate, _kernel

    rows, words = args.rows, -(-args.vocab // 32)
    masks = StepBitmasks(words, "cuda", rows)
    gate = FillGate(torch.device("cuda"))
    logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16)
    shared = masks.shared
    shared.tensor.fill_(-1)
    slot, number = 0, 7
    shared.flags[slot] = number  # set before each call: the wait returns at once
    wait = _kernel()
    spins, expect, seen = gate._args[slot]
    flag = shared.flags[slot : slot + 1]
    words_of_slot = shared.tensor[slot][:rows]

    def read() -> None:
        masks.read(logits, slot, number, rows, gate)

    def apply() -> None:
        gate.apply(logits, shared.tensor, shared.flags, slot, number, rows)

    def wait_alone() -> None:
        wait((1,), spins, flag, expect, seen, gate.limit, TIMED=gate.timed, num_warps=1)

    pieces: dict[str, Callable[[], object]] = {
        "StepBitmasks.read (all of it)": read,
        "FillGate.apply (wait, mask)": apply,
        "wait kernel launch": wait_alone,
        "mask kernel launch": lambda: kernel_token_mask(logits, words_of_slot, None),
        "views (flag, slot rows, logits rows)": lambda: (
            shared.flags[slot : slot + 1], shared.tensor[slot][:rows], logits[:rows]
        ),
        "event record": lambda: masks._copied[slot].record(),
        "argmax (two launches)": lambda: argmax_rows(logits),
        "StepBitmasks.choose (argmax, future)": lambda: masks.choose(logits, slot, number, rows, gate),
        "FillGate.argmax (flagged argmax alone)": lambda: gate.argmax(
            logits, shared.tensor, shared.flags, slot, number, rows
        ),
        "empty torch op (logits[:1].zero_())": lambda: logits[:1].zero_(),
    }  # fmt: skip
    for fn in pieces.values():  # compile and record each launch
        fn()
    result = {name: _median_us(fn, args.calls) for name, fn in pieces.items()}
    print(f"rows {rows}, vocab {args.vocab}, {torch.cuda.get_device_name()}: host us a call (median)")
    for name, us in result.items():
        print(f"  {name:40s} {us:8.2f}")
    if args.out:
        meta = {"rows": rows, "vocab": args.vocab, "device": torch.cuda.get_device_name(),
                "commit": os.environ.get("PREFIXSERVE_COMMIT"), "torch": torch.__version__}  # fmt: skip
        write_json(Path(args.out), {"settings": meta, "host_us": result}, indent=1)


if __name__ == "__main__":
    main()
