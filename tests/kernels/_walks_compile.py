"""Compile the paged kernel's e4m3 decode walk cut into walks (``attend.attend_range_walks``: PAGES_AHEAD 0,
64-key tiles, 16-row tiles) for sm_90 with fp32 q, without a GPU; one JSON line: whether the walks'
batched products are there, and how many tf32 MMAs the PTX holds (fp32 q asks DOT_PREC "ieee").
A separate process, as ``_window_compile.py`` (no ``TRITON_INTERPRET``).

Usage: python _walks_compile.py
"""

from __future__ import annotations

import json
import re


def main() -> None:
    from benchmarks.harness.sm90 import compile_for_sm90
    from prefixserve.attention.kernels import paged_attention

    kernel = paged_attention._paged_kernel
    consts = {"GROUP": 4, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 64, "BLOCK_SIZE": 16, "DOT_PREC": "ieee"}
    consts |= {"UPCAST": False, "ONE_TILE": True, "MERGE": False, "BLOCK_G": 4, "WANT_LSE": False}
    consts |= {"MERGE_UNROLL": 8, "PAGES_AHEAD": 0, "WALKS": 4}
    types = {"q_ptr": "*fp32", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "bt_ptr": "*i32"}
    types |= {"seq_lens_ptr": "*i32"}
    types |= {"qsl_ptr": "*i32", "qk_scale": "fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*fp32"}
    types |= {"out_lse_ptr": "*fp32", "count_ptr": "*i32"}
    compiled = compile_for_sm90(kernel, types, consts)
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    walks = bool(re.search(r"tt\.dot [^\n]*tensor<4x16x", ttgir))
    print(json.dumps({"walks": walks, "tf32_mma": len(re.findall(r"mma[^;\n]*\.tf32", ptx))}))


if __name__ == "__main__":
    main()
