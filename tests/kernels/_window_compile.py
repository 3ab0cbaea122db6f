"""Compile the window kernel (both forms), the paged kernel and the packed decode kernel for sm_90 without
a GPU; one JSON line each (with the decode kernels' ``ldmatrix`` count). A separate process, as
``_gluon_compile.py`` says why (no ``TRITON_INTERPRET``): the real compiler checks what the interpreter
lets through (``attend_range``'s window bound, its keyword call).

Usage: python _window_compile.py
"""

from __future__ import annotations

import json


def compile_for_hopper(kernel, types: dict[str, str], consts: dict[str, object]):
    from benchmarks.harness.sm90 import compile_for_sm90

    return compile_for_sm90(kernel, types, consts)


def emit(kernel: str, skip: bool, compiled) -> None:
    """One JSON line: the kernel's form, whether it compiled to a cubin, its ``ldmatrix`` and
    ``cp.async`` counts."""
    from benchmarks.probes.ptx_census import census

    record = {"kernel": kernel, "skip": skip, "ok": bool(compiled.asm.get("cubin"))}
    counts = census(compiled.asm["ptx"])
    print(json.dumps(record | {"ldmatrix": counts["ldmatrix"], "cp_async": counts["cp.async"]}))


def main() -> None:
    from benchmarks.probes.ptx_census import compile_packed
    from prefixserve.attention.kernels import paged_attention, window_attention

    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32"}
    ptrs |= {"qsl_ptr": "*i32", "skip_lo_ptr": "*i32", "skip_hi_ptr": "*i32", "qk_scale": "fp32"}
    ptrs |= {"base_ptr": "*i32"}
    common = {"BLOCK_M": 16, "BLOCK_SIZE": 16, "DOT_PREC": "tf32", "UPCAST": False}
    for skip in (False, True):  # with a table base (a sliding group's) where skipping, without else
        types = ptrs | {"o_ptr": "*fp32" if skip else "*bf16", "lse_ptr": "*fp32"}
        consts = common | {"GROUP": 2, "BLOCK_N": 32, "HEAD_DIM": 256, "SKIP": skip, "BASE": skip}
        emit("window", skip, compile_for_hopper(window_attention._window_kernel, types, consts))
    types = ptrs | {"o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16", "out_lse_ptr": "*fp32"}
    types |= {"count_ptr": "*i32"}
    for merge in (False, True):  # a decode step's splits merged by the last program (``merge_last``),
        # their block ids read ahead of the walk (``attend_range_ahead``, tl.gather)
        consts = common | {"GROUP": 4, "BLOCK_N": 64, "HEAD_DIM": 128, "ONE_TILE": True}
        consts |= {"MERGE": merge, "BLOCK_G": 4, "WANT_LSE": merge, "MERGE_UNROLL": 4}
        consts |= {"PAGES_AHEAD": 32 if merge else 0, "WALKS": 1}
        emit("paged", merge, compile_for_hopper(paged_attention._paged_kernel, types, consts))
    # over an e4m3 cache: bf16 q widened to fp16 (``attend.widened_q``), the merged form, its tiles
    # loaded into registers a tile ahead and widened once (``attend.attend_range_fetched``): their
    # operands read by ldmatrix as a bf16 cache's are
    types |= {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
    emit("paged_e4m3", True, compile_for_hopper(paged_attention._paged_kernel, types, consts))
    # a tile's ids at a time (no merge): the tiles cut into a walk a warp (``attend.attend_range_walks``)
    consts |= {"MERGE": False, "WANT_LSE": False, "PAGES_AHEAD": 0, "WALKS": 4}
    emit("paged_e4m3", False, compile_for_hopper(paged_attention._paged_kernel, types, consts))
    for kv in ("*bf16", "*fp8e4nv"):  # the packed decode kernel (several sequences a query tile)
        emit("packed" if kv == "*bf16" else "packed_e4m3", False, compile_packed(kv, 2))


if __name__ == "__main__":
    main()
