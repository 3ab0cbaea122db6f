"""Compile ``kernels/ranks_norm.py`` for sm_90 without a GPU and count its PTX's global loads.

A separate process: tests/kernels/conftest.py sets TRITON_INTERPRET=1, under which nothing is
compiled, and the interpreter runs a jit function's Python as it is (a non-constexpr global or a
load the compiler cannot vectorise shows only here). Pointer and size arguments carry the 16-byte
divisibility Triton's launcher gives aligned ones. Prints one JSON line per (ranks, block).
"""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

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
ALIGNED = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11)  # argument positions with 16-byte divisibility

for ranks in (3, 4):
    for block, warps in ((4096, 8), (8192, 16)):
        consts = {"RANK": 1, "RANKS": ranks, "BLOCK": block, "HAS_RESIDUAL": True}
        src = ASTSource(
            fn=ranks_norm._ranks_add_rms_norm_kernel,
            signature={**SIGNATURE, **dict.fromkeys(consts, "constexpr")},
            constexprs=consts,
            attrs={(i,): [["tt.divisibility", 16]] for i in ALIGNED},
        )
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        counts = {
            "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
            "b16_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b16\s", ptx)),
        }
        print(json.dumps({"ranks": ranks, "block": block, **counts}), flush=True)
