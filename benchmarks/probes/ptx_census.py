"""Probe (CPU, no GPU): the decode kernels (paged, packed) and the shared-segment kernel compiled for sm_90
by Triton's own compiler, and a count of the PTX instructions that say how its K / V tiles travel:
asynchronous copies into shared memory (``cp.async``), operand loads from it (``ldmatrix`` or plain
``ld.shared``), byte shuffles (``prmt``), e4m3 widenings (``cvt.rn.f16x2.e4m3x2``), tensor-core products
(``mma``), and the shared memory the pipeline holds. By KV dtype (bf16, e4m3), pipeline stages, and
block ids read ahead or a tile's at a time; e4m3 tiles widened by the kernels' inline PTX or
(``--widening cast``) by Triton's own cast. Pointers and strides are declared 16-byte divisible, as
Triton specializes them at a launch (without that nothing is vectorized or copied asynchronously, and
the census would mislead).

    PYTHONPATH=. python -m benchmarks.probes.ptx_census [--stages 2 3] [--ahead 0 32] [--widening cast]
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from benchmarks.harness.sm90 import compile_for_sm90

# a column's instructions by prefix; ``cp.async`` counts the copies only (not their commit / wait groups)
OPS = {
    "cp.async": ("cp.async.ca", "cp.async.cg", "cp.async.bulk"),
    "ldmatrix": ("ldmatrix",),
    "ld.shared": ("ld.shared",),
    "st.shared": ("st.shared",),
    "prmt": ("prmt",),
    "cvt.rn.f16x2.e4m3x2": ("cvt.rn.f16x2.e4m3x2",),
    "mma": ("mma",),
    "wgmma": ("wgmma",),
    "bar.sync": ("bar.sync",),
}


def _aligned(kernel: Any, consts: dict[str, object], unaligned: tuple[str, ...] = ()) -> list[str]:
    """Pointers and strides Triton's launcher would see 16-byte divisible (all but ``unaligned``)."""
    names = [n for n in kernel.arg_names if n not in consts and n not in unaligned]
    return [n for n in names if n.endswith("_ptr") or n.startswith("stride")]


def compile_paged(kv: str, stages: int, ahead: int) -> Any:
    """``_paged_kernel`` (decode: one query tile, GQA 4, 128-wide heads, 64-token tiles of 16-token
    blocks) compiled for sm_90 over a ``kv`` cache (``*bf16`` or ``*fp8e4nv``)."""
    from prefixserve.attention.kernels.paged_attention import _paged_kernel as kernel

    consts = {"BLOCK_M": 16, "BLOCK_SIZE": 16, "DOT_PREC": "tf32", "UPCAST": False, "GROUP": 4}
    consts |= {"BLOCK_N": 64, "HEAD_DIM": 128, "ONE_TILE": True, "MERGE": False, "BLOCK_G": 4}
    consts |= {"WANT_LSE": False, "MERGE_UNROLL": 8, "PAGES_AHEAD": ahead, "WALKS": 0}  # 0: E4M3_WALKS
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "bt_ptr": "*i32", "seq_lens_ptr": "*i32"}
    types |= {"qsl_ptr": "*i32", "qk_scale": "fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32"}
    types |= {"out_ptr": "*bf16", "out_lse_ptr": "*fp32", "count_ptr": "*i32"}
    aligned = _aligned(kernel, consts, ("stride_bt",))
    return compile_for_sm90(kernel, types, consts, aligned, num_stages=stages)


def compile_packed(kv: str, stages: int) -> Any:
    """``_packed_decode_kernel`` (4 sequences a program, GQA 4, 128-wide heads, 16 tokens of each a
    tile) compiled for sm_90 over a ``kv`` cache."""
    from prefixserve.attention.kernels.packed_decode import _packed_decode_kernel as kernel

    consts = {"GROUP": 4, "PACK": 4, "BLOCK_M": 16, "CHUNK": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16}
    consts |= {"DOT_PREC": "tf32", "UPCAST": False}
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "bt_ptr": "*i32", "seq_lens_ptr": "*i32"}
    types |= {"qsl_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    aligned = _aligned(kernel, consts, ("stride_bt",))
    return compile_for_sm90(kernel, types, consts, aligned, num_stages=stages)


def compile_shared(kv: str, stages: int) -> Any:
    """``_shared_kernel`` (64-row query tiles of one shared segment, GQA 4, 128-wide heads, 64-token
    KV tiles of 16-token blocks, no TMA) compiled for sm_90 over a ``kv`` cache."""
    from prefixserve.attention.kernels.shared_attention import _shared_kernel as kernel

    consts = {"GROUP": 4, "BLOCK_M": 64, "BLOCK_N": 64, "HEAD_DIM": 128, "BLOCK_SIZE": 16}
    consts |= {"DOT_PREC": "tf32", "UPCAST": False, "USE_TMA": False, "TAIL_STAGES": 1}
    consts |= {"k_desc": None, "v_desc": None}
    types = {"q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "seg_blocks_ptr": "*i32"}
    types |= {"seg_block_start_ptr": "*i32", "seg_rows_ptr": "*i32", "items_ptr": "*i32"}
    types |= {"o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    return compile_for_sm90(kernel, types, consts, _aligned(kernel, consts), num_stages=stages)


def choose_widening(widening: str) -> None:
    """``cast``: this process's kernels widen e4m3 tiles by Triton's own cast, for a side by side with
    the inline PTX (``attend.widened_kv``). Before the first compile: Triton refuses a global changed
    after a kernel read it."""
    if widening == "cast":
        from prefixserve.attention.kernels import attend

        attend.OPAQUE_WIDENING = attend.tl.constexpr(False)


def choose_walks(walks: int) -> None:
    """This process's fetched e4m3 walks cut into ``walks`` runs a program (``attend.E4M3_WALKS``),
    before the first compile."""
    from prefixserve.attention.kernels import attend

    attend.E4M3_WALKS = attend.tl.constexpr(walks)


def choose_fetch(fetch: str) -> None:
    """``pipeline``: this process's kernels read e4m3 tiles through Triton's software pipeline (shared
    memory) instead of into registers a tile ahead (``attend.attend_range_fetched``); before the first
    compile, as ``choose_widening``."""
    if fetch == "pipeline":
        from prefixserve.attention.kernels import attend

        attend.FETCH_E4M3_AHEAD = attend.tl.constexpr(False)


def census(ptx: str) -> dict[str, int]:
    """How many instructions of each of ``OPS`` the PTX holds (predicated ones too)."""
    counts = dict.fromkeys(OPS, 0)
    for line in ptx.splitlines():
        for statement in re.split(r"[;{}]", line):  # inline PTX puts several on a line
            m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", statement)
            if m:
                for op, prefixes in OPS.items():
                    if m.group(1).startswith(prefixes):
                        counts[op] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--ahead", nargs="+", type=int, default=[0, 32], help="PAGES_AHEAD (0: a tile's ids)")
    ap.add_argument(
        "--widening",
        choices=("opaque", "cast"),
        default="opaque",
        help="e4m3 tiles widened by the kernels' inline PTX (attend.widened_kv) or by Triton's own cast",
    )
    ap.add_argument(
        "--fetch",
        choices=("registers", "pipeline"),
        default="registers",
        help="e4m3 tiles loaded into registers a tile ahead or through Triton's pipeline",
    )
    args = ap.parse_args()
    choose_widening(args.widening)
    choose_fetch(args.fetch)
    print(f"e4m3 widening: {args.widening}, fetch: {args.fetch}")
    print("| kernel | KV | stages | ids ahead | shared KB | " + " | ".join(OPS) + " |")
    print("| --- | --- | ---: | ---: | ---: |" + " ---: |" * len(OPS))
    for kv in ("*bf16", "*fp8e4nv"):
        forms = [("paged", stages, ahead) for ahead in args.ahead for stages in args.stages]
        forms += [(name, stages, 0) for name in ("packed", "shared") for stages in args.stages]
        for name, stages, ahead in forms:
            if name == "paged":
                compiled = compile_paged(kv, stages, ahead)
            else:
                compiled = (compile_packed if name == "packed" else compile_shared)(kv, stages)
            counts = census(compiled.asm["ptx"])
            cells = " | ".join(str(counts[op]) for op in OPS)
            kb = compiled.metadata.shared / 1024
            print(f"| {name} | {kv[1:]} | {stages} | {ahead} | {kb:.1f} | {cells} |")


if __name__ == "__main__":
    main()
