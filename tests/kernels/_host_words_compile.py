"""Compile the kernels that read a grammar's mask from pinned host memory for sm_90 without a GPU;
prints one JSON line each: how the slot's 32-bit words are loaded.

A separate process (``_gluon_compile.py`` says why: no ``TRITON_INTERPRET``). Triton 3.6 drops a
``.cv`` cache modifier from the PTX, so the words must be ``volatile`` loads (``ld.volatile``).
"""

from __future__ import annotations

import json
import re

VOLATILE_WORD = r"ld\.volatile\.global\.b32"  # a 32-bit mask word, fetched afresh
PLAIN_WORD = r"ld\.global(\.\w+)*\.b32"  # a 32-bit load that may hit a cached line


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
    mask = ptx(
        _kernel()[1].kernel,
        {"logits_ptr": "*bf16", "mask_ptr": "*i32", "index_ptr": "*i64", "stride_l": "i32", "stride_m": "i32",
         "vocab": "i32"},
        {"HAS_INDEX": False, "BLOCK_W": 64, "VOLATILE": True},
    )  # fmt: skip
    for name, text in (("flagged_chunk_argmax", flagged), ("apply_token_mask", mask)):
        print(json.dumps({
            "kernel": name,
            "volatile_words": len(re.findall(VOLATILE_WORD, text)),
            "plain_words": len(re.findall(PLAIN_WORD, text)),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
