"""Compile the kernels that wait for a grammar's fill and read its mask from pinned host memory for
sm_90 without a GPU; prints one JSON line each: how the 64-bit flag words and the 32-bit mask words
are loaded.

A separate process (``_gluon_compile.py`` says why: no ``TRITON_INTERPRET``). The polls must be
``ld.volatile`` (a plain load in a loop is hoisted out of it: the wait never sees the host's write);
the mask words plain (Triton 3.6 drops a ``.cv`` modifier, and volatile word loads cost a small
model's step 0.8 ms on an H200).
"""

from __future__ import annotations

import json
import re

VOLATILE_WORD = r"ld\.volatile\.global\.b32"  # a 32-bit mask word, one PCIe read each
PLAIN_WORD = r"ld\.global(\.\w+)*\.b32"  # 32-bit mask words, vectorised
VOLATILE_FLAG = r"ld\.volatile\.global\.b64"  # a poll of a 64-bit flag (or the verdict)


def ptx(kernel, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=kernel, signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def main() -> None:
    from prefixserve.sampling import argmax_kernels
    from prefixserve.sampling.token_mask import _kernel
    from prefixserve.triton_support import host_flag

    flagged = ptx(
        argmax_kernels.flagged_chunk_argmax,
        {
            "x_ptr": "*bf16", "stride_x": "i32", "vocab": "i32", "chunk": "i32", "max_ptr": "*fp32",
            "idx_ptr": "*i32", "nan_ptr": "*i32", "splits": "i32", "words_ptr": "*i32", "stride_w": "i32",
            "masked_rows": "i32", "flag_ptr": "*i64", "number": "i32", "limit": "i64", "seen_ptr": "*i64",
            "late_ptr": "*i64", "spins_ptr": "*i64", "go_ptr": "*i64",
        },
        {"BLOCK": 1024, "NONE": 2**31 - 1, "TIMED": True},
    )  # fmt: skip
    wait = ptx(
        host_flag.wait_for_fill,
        {"spins_ptr": "*i64", "flag_ptr": "*i64", "expect_ptr": "*i64", "seen_ptr": "*i64", "limit": "i64"},
        {"TIMED": True},
    )
    mask = ptx(
        _kernel()[1].kernel,
        {"logits_ptr": "*bf16", "mask_ptr": "*i32", "index_ptr": "*i64", "stride_l": "i32", "stride_m": "i32",
         "vocab": "i32"},
        {"HAS_INDEX": False, "BLOCK_W": 64},
    )  # fmt: skip
    kernels = (("flagged_chunk_argmax", flagged), ("wait_for_fill", wait), ("apply_token_mask", mask))
    for name, text in kernels:
        print(json.dumps({
            "kernel": name,
            "volatile_words": len(re.findall(VOLATILE_WORD, text)),
            "plain_words": len(re.findall(PLAIN_WORD, text)),
            "volatile_flags": len(re.findall(VOLATILE_FLAG, text)),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
