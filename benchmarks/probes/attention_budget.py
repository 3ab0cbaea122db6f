"""Where the 70B's TP=2 attention call spends its energy at the board's power cap (issue 51's 3x).

A 70B sharing-on decode step at B=256, P=16K runs at the power cap, where a call's time is its energy
(docs/kernels.md §8), and 3x sharing on / off needs about 0.9 ms off a step: 11 us off each of its
80 attention calls. This probe prices the parts of one call (one segment, ``launch_modes``'s
``two_kernels``: the shared Gluon kernel beside the paged own kernel, then the merge), each back to
back for S seconds with the board's power, in microseconds a call and millijoules above the spin
kernel's floor:

- the whole call at several own lengths (the own part's price a token), and each launch alone;
- ``no_reload``: the call with the shared kernel's loader patched to fetch K / V for a ticket's
  first ring slots only, every later tile reusing a slot's stale contents (wrong outputs; the
  engine's code is untouched). What it saves is the most any change to how K / V reach the SMs
  could: the later L2 reads that a multicast would share, and the first read from HBM too.

Each variant runs in a process of its own (Triton compiles the patched loader there), variants in
turn for ``--rounds`` rounds.

    PYTHONPATH=. python -m benchmarks.probes.attention_budget [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.output import write_or_print
from prefixserve.attention.kernels.gluon_attend import GLUON

VARIANTS = ("engine", "no_reload")
NO_RELOAD_CACHE = Path(tempfile.gettempdir()) / "prefixserve_probe_no_reload"


if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from prefixserve.attention.kernels.gluon_attend import _item_range

    @gluon.jit
    def _load_first_slots(
        k_desc,
        v_desc,
        k_bufs,
        v_bufs,
        k_ready,
        v_ready,
        kv_empty,
        items_ptr,
        num_items,
        first,
        end,
        step,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """``gluon_attend._load_partition`` fetching only a program's first STAGES tiles."""
        c = 0
        for t in range(first, end, step):
            base, _lo, _hi, _len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            row0 = gl.load(base + 6)
            col = (t // num_items) * HEAD_DIM
            for i in range(n_tiles):
                s = c % STAGES
                mbarrier.wait(kv_empty.index(s), ((c // STAGES) & 1) ^ 1)
                if c < STAGES:
                    row = row0 + i * BLOCK_N
                    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_bufs.index(s))
                    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_bufs.index(s))
                else:  # the slot as it is: the consumers' barriers complete without a copy
                    mbarrier.arrive(k_ready.index(s), count=1)
                    mbarrier.arrive(v_ready.index(s), count=1)
                c += 1


def measure(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One process's rows: the call at each own length, then each launch alone (``engine``) or the
    call at the first own length (``no_reload``)."""
    from benchmarks import power
    from benchmarks.attention import Case
    from benchmarks.harness.timing import PART_OF, bench_ms, graphed
    from benchmarks.probes.launch_modes import call
    from prefixserve.attention.step_launch import relaunch_layer

    if variant == "no_reload":  # before the first compile: the kernel looks its loader up then
        from prefixserve.attention.kernels import shared_gluon

        shared_gluon._load_partition = _load_first_slots
    dev = torch.device("cuda")
    heads = tuple(int(x) for x in args.heads.split("/"))
    sampler = power.Sampler(gpu=str(dev.index or 0))
    floor_w = power.spin_floor_w(sampler)
    rows: list[dict[str, Any]] = []

    def add(what: str, own: int, fn: Any) -> None:
        b2b = power.back_to_back(fn, sampler, args.seconds, floor_w)
        rows.append({"what": what, "own": own, "burst_us": 1e3 * bench_ms(fn)} | b2b)

    owns = args.owns if variant == "engine" else args.owns[:1]
    for own in owns:
        case = Case(args.batch, args.prefix, own, dev, heads=heads)
        fn, lay, _ = call(case, "two_kernels")
        add("call", own, fn)
        if own == args.owns[0]:
            tensors = (case.q, case.k_cache, case.v_cache, torch.empty_like(case.q))
            for launch, pos, _ in lay.launches:
                name = getattr(launch.kernel, "__name__", "?")
                if variant == "engine" or PART_OF.get(name) == "shared":
                    one = graphed(lambda la=launch, po=pos, ts=tensors: relaunch_layer(la, po, ts))
                    add(PART_OF.get(name, name), own, one)
        del case, fn, lay
        torch.cuda.empty_cache()
    sampler.close()
    return {"variant": variant, "floor_w": floor_w, "rows": rows}


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"# The 70B TP=2 attention call's energy at the cap ({result['device']}, {result['date']}, "
        f"commit {result['commit']})",
        "",
        f"Heads {s['heads']}, B={s['batch']}, P={s['prefix']}; each row back to back {s['seconds']} s; "
        "rounds in turn, each variant in a process of its own; mJ a call above the spin kernel's floor "
        "(floors: " + ", ".join(f"{r['floor_w']:.0f}" for r in result["runs"]) + " W).",
        "",
        "| variant | what | own tokens | burst us | back to back us | board W | SM MHz | mJ above floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in result["runs"]:
        for r in run["rows"]:
            lines.append(
                f"| {run['variant']} | {r['what']} | {r['own']} | {r['burst_us']:.1f} | {r['us']:.1f} | "
                f"{r['power_w']:.0f} | {r['sm_mhz'] or '-'} | {r['mj_above_floor']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="32/4", help="query / KV heads (the 70B's TP=2 shard)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument(
        "--owns", type=int, nargs="+", default=[128, 16, 64, 192], help="own tokens; parts at the first"
    )
    ap.add_argument("--seconds", type=float, default=1.5, help="back to back, each row")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", choices=VARIANTS, default=None, help="(a child process's one variant)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args)))
        return
    from benchmarks.harness.info import run_info

    result = run_info() | {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "variant")}}
    result["runs"] = []
    child = [sys.executable, "-m", "benchmarks.probes.attention_budget"]
    child += ["--heads", args.heads, "--batch", str(args.batch), "--prefix", str(args.prefix)]
    child += ["--owns", *map(str, args.owns), "--seconds", str(args.seconds)]
    for _ in range(args.rounds):
        for variant in VARIANTS:
            # the patched kernel compiles into a cache of its own (the engine's entry is never reused)
            env = os.environ | ({"TRITON_CACHE_DIR": str(NO_RELOAD_CACHE)} if variant == "no_reload" else {})
            out = subprocess.run([*child, "--variant", variant], capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(f"the {variant} process failed:\n{out.stderr[-4000:]}")
            result["runs"].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(result["runs"][-1]), file=sys.stderr, flush=True)
    write_or_print(args.json, result, report(result) + "\n")


if __name__ == "__main__":
    main()
