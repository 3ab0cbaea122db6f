"""Probe (CPU, no GPU): the paged decode kernel compiled for sm_90 by Triton's own compiler, and a count
of the PTX instructions that say how its K / V tiles travel: asynchronous copies into shared memory
(``cp.async``), operand loads from it (``ldmatrix`` or plain ``ld.shared``), byte shuffles (``prmt``),
e4m3 widenings (``cvt.rn.f16x2.e4m3x2``), tensor-core products (``mma``), and the shared memory the
pipeline holds. By KV dtype (bf16, e4m3), pipeline stages, and block ids read ahead or a tile's at a
time. Pointers and strides are declared 16-byte divisible, as Triton specializes them at a launch
(without that nothing is vectorized or copied asynchronously, and the census would mislead).

    PYTHONPATH=. python -m benchmarks.probes.ptx_census [--stages 2 3] [--ahead 0 32]
"""

from __future__ import annotations

import argparse
import re
from typing import Any

OPS = ("cp.async", "ldmatrix", "ld.shared", "st.shared", "prmt", "cvt.rn.f16x2.e4m3x2", "mma", "bar.sync")


def compile_paged(kv: str, stages: int, ahead: int) -> Any:
    """``_paged_kernel`` (decode: one query tile, GQA 4, 128-wide heads, 64-token tiles of 16-token
    blocks) compiled for sm_90 over a ``kv`` cache (``*bf16`` or ``*fp8e4nv``)."""
    from benchmarks.harness.sm90 import compile_for_sm90
    from prefixserve.attention.kernels.paged_attention import _paged_kernel as kernel

    consts = {"BLOCK_M": 16, "BLOCK_SIZE": 16, "DOT_PREC": "tf32", "UPCAST": False, "GROUP": 4}
    consts |= {"BLOCK_N": 64, "HEAD_DIM": 128, "ONE_TILE": True, "MERGE": False, "BLOCK_G": 4}
    consts |= {"WANT_LSE": False, "MERGE_UNROLL": 8, "PAGES_AHEAD": ahead}
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "bt_ptr": "*i32", "seq_lens_ptr": "*i32"}
    types |= {"qsl_ptr": "*i32", "qk_scale": "fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32"}
    types |= {"out_ptr": "*bf16", "out_lse_ptr": "*fp32", "count_ptr": "*i32"}
    aligned = [n for n in kernel.arg_names if n not in consts and n != "stride_bt"]
    aligned = [n for n in aligned if n.endswith("_ptr") or n.startswith("stride")]
    return compile_for_sm90(kernel, types, consts, aligned, num_stages=stages)


def census(ptx: str) -> dict[str, int]:
    """How many instructions of each of ``OPS`` the PTX holds (predicated ones too)."""
    counts = dict.fromkeys(OPS, 0)
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", line)
        if m:
            for op in OPS:
                if m.group(1).startswith(op):
                    counts[op] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--ahead", nargs="+", type=int, default=[0, 32], help="PAGES_AHEAD (0: a tile's ids)")
    args = ap.parse_args()
    print("| KV | stages | ids ahead | shared KB | " + " | ".join(OPS) + " |")
    print("| --- | ---: | ---: | ---: |" + " ---: |" * len(OPS))
    for kv in ("*bf16", "*fp8e4nv"):
        for ahead in args.ahead:
            for stages in args.stages:
                compiled = compile_paged(kv, stages, ahead)
                counts = census(compiled.asm["ptx"])
                cells = " | ".join(str(counts[op]) for op in OPS)
                print(f"| {kv[1:]} | {stages} | {ahead} | {compiled.metadata.shared / 1024:.1f} | {cells} |")


if __name__ == "__main__":
    main()
