"""Compile ``kernels/ranks_norm.py`` for sm_90 without a GPU and count its PTX's global loads.

A separate process: tests/kernels/conftest.py sets TRITON_INTERPRET=1, under which nothing is
compiled, and the interpreter runs a jit function's Python as it is (a non-constexpr global or a
load the compiler cannot vectorise shows only here). Pointer and size arguments carry the 16-byte
divisibility Triton's launcher gives aligned ones. Prints one JSON line per (ranks, block).
"""

from __future__ import annotations

import json
import re

from benchmarks.harness.sm90 import compile_for_sm90
from prefixserve.model.kernels import ranks_norm

SIGNATURE = {
    "products_ptr": "*i64",
    "res_ptr": "*bf16",
    "w_ptr": "*bf16",
    "out_ptr": "*bf16",
    "res_out_ptr": "*bf16",
    "my_counts_ptr": "*i64",
    "counts_table_ptr": "*i64",
    "calls_ptr": "*i64",
    "abort_ptr": "*i32",
    "n_rows": "i32",
    "n_cols": "i32",
    "stride": "i32",
    "eps": "fp32",
}
ALIGNED = [n for n in SIGNATURE if n not in ("n_rows", "eps")]  # arguments with 16-byte divisibility

for ranks in (3, 4):
    for block, warps in ((4096, 8), (8192, 16)):
        consts = {"RANK": 1, "RANKS": ranks, "BLOCK": block, "HAS_RESIDUAL": True}
        kernel = ranks_norm._ranks_add_rms_norm_kernel
        ptx = compile_for_sm90(kernel, SIGNATURE, consts, ALIGNED, num_warps=warps).asm["ptx"]
        counts = {
            "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
            "b16_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b16\s", ptx)),
        }
        print(json.dumps({"ranks": ranks, "block": block, **counts}), flush=True)
