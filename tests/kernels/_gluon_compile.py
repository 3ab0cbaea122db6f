"""Compile the Gluon shared and mixed kernels for sm_90 without a GPU; prints one JSON per shape.

A separate process: tests/kernels/conftest.py sets TRITON_INTERPRET=1 for the tl kernels before
Triton is imported, and under it Triton's own library functions (``gl.max``...) are built for the
interpreter, which the real compiler refuses.

Usage: python _gluon_compile.py KERNEL:GROUP:DIM:DTYPE [...]   (KERNEL shared, shared192: the shared kernel
with 192-row tiles, sharedfp8 / shared192fp8: either over an e4m3 cache, sharedfp8mma: the kernel
whose products run on FP8 tensor cores (shared_gluon_fp8), mixed, mixed128: the mixed
kernel with 128-row own tiles, or mixedheavy: with 128-token shared tiles; DTYPE bf16 or fp16)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

import torch

SETMAXNREG = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)"  # register counts the partitions ask for


def compile_for_hopper(group: int, dim: int, dtype: torch.dtype, kernel_name: str = "shared"):
    """triton.compile of the shipped configuration of the shared (or the mixed) kernel for sm_90."""
    own_m = 128 if kernel_name == "mixed128" else 64
    block_m = 192 if kernel_name.startswith("shared192") else 128
    fp8 = kernel_name.endswith("fp8")
    shared_n = 128 if kernel_name == "mixedheavy" else 64
    fp8mma = kernel_name == "sharedfp8mma"
    fp8 = fp8 or fp8mma
    kernel_name = "mixed" if kernel_name.startswith("mixed") else "shared"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from prefixserve.attention.kernels import gluon_attend, mixed_gluon, shared_gluon, shared_gluon_fp8
    from prefixserve.attention.planning import mixed_rule

    cache = torch.zeros(8, 16, 2, dim, dtype=torch.float8_e4m3fn if fp8 else dtype)
    desc = mangle_type(gluon_attend.gluon_descriptor(cache, 128))
    elt = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    kv_elt = "*fp8e4nv" if fp8 else elt
    types = {"q_ptr": elt, "k_ptr": kv_elt, "v_ptr": kv_elt, "k_desc": desc, "v_desc": desc}
    types |= {"seg_rows_ptr": "*i32", "items_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
    types["qk_scale"] = "fp32"
    consts = {"GROUP": group, "BLOCK_M": block_m, "BLOCK_N": 128, "HEAD_DIM": dim, "STAGES": 3}
    if kernel_name == "mixed":
        kernel = mixed_gluon.mixed_gluon_kernel
        desc = mangle_type(gluon_attend.gluon_descriptor(cache, shared_n))
        own = mangle_type(mixed_gluon.own_descriptor(cache, own_m))
        types |= {"k_desc": desc, "v_desc": desc, "ko_desc": own, "vo_desc": own}
        types |= {"own_tables_ptr": "*i32", "own_lens_ptr": "*i32", "count_ptr": "*i32"}
        ht, rows = mixed_rule.own_tiling(group * 8, 8, 16, own_m)  # 8 KV heads, as the 8B models
        shared_stages, own_stages = mixed_gluon.ring_stages(own_m, shared_n)
        consts |= {"BLOCK_N": shared_n, "STAGES": shared_stages}
        consts |= {"OWN_STAGES": own_stages, "OWN_M": own_m, "PTXAS": mixed_gluon.PTXAS_BUILD}
        consts |= {"BLOCK_SIZE": 16, "OWN_ROWS": rows, "HT": ht}
        maxnreg = mixed_gluon.MAXNREG
    elif fp8mma:  # the products on FP8 tensor cores: as shared_gluon_fp8.launch sets it
        kernel = shared_gluon_fp8.shared_fp8mma_kernel
        f8 = shared_gluon_fp8
        consts |= {"BLOCK_N": f8.BLOCK_N, "STAGES": f8.STAGES, "VT_STAGES": f8.VT_STAGES}
        consts |= {"CONSUMER_REGS": f8.CONSUMER_REGS, "TRANSPOSE_REGS": f8.TRANSPOSE_REGS}
        del consts["BLOCK_M"]
        maxnreg = f8.MAXNREG
    else:
        kernel = shared_gluon.shared_gluon_kernel
        maxnreg = shared_gluon.MAXNREG if block_m == 128 else shared_gluon.MAXNREG_WIDE
        consts |= {"OVERLAP": block_m == 128, "CONSUMER_REGS": shared_gluon.CONSUMER_REGS[block_m]}
        consts |= {"WIDEN_STAGES": 0, "WIDEN_REGS": 0}
        if block_m == 192:
            consts["STAGES"] = 2  # shared_plan.SHARED_WIDE_TMA
        if fp8:  # as launch_shared_gluon sets them over an e4m3 cache
            block_n, stages = shared_gluon.FP8_TILES[block_m]
            desc = mangle_type(gluon_attend.gluon_descriptor(cache, block_n))
            types |= {"k_desc": desc, "v_desc": desc}
            consts |= {"BLOCK_N": block_n, "STAGES": stages, "WIDEN_STAGES": shared_gluon.FP8_LANDING_SLOTS}
            consts["CONSUMER_REGS"] = shared_gluon.FP8_CONSUMER_REGS[block_m]
            consts["WIDEN_REGS"] = shared_gluon.FP8_WIDEN_REGS[block_m]
            maxnreg = shared_gluon.FP8_MAXNREG[block_m]
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    src = GluonASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(c),): v for c, v in consts.items()},
    )
    options = {"num_warps": 4, "maxnreg": maxnreg}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def wgmma_serialized(ptx: str, ptxas: str) -> bool:
    """True when ``ptxas`` (run on the PTX) serializes the wgmmas: it does so where it cannot keep an
    async product in flight, and the kernels' overlap depends on it (docs/kernels.md §2.5)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        cmd = [ptxas, "-arch=sm_90a", "-v", src.name, "-o", "/dev/null"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return "wgmma.mma_async instructions are serialized" in log


def main(shapes: list[str]) -> None:
    from triton.backends.nvidia.compiler import get_ptxas

    from prefixserve.attention import _ptxas

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for shape in shapes:
        kernel, group, dim, dtype = shape.split(":")
        built = len(_ptxas.BUILT)
        compiled = compile_for_hopper(int(group), int(dim), dtypes[dtype], kernel)
        ptx = compiled.asm["ptx"]
        newer = len(_ptxas.BUILT) > built  # the cubin came from ptxas >= 12.9 (``_ptxas``)
        ptxas = _ptxas.newer_ptxas()[0] if newer else get_ptxas(90).path
        print(
            json.dumps(
                {
                    "shape": shape,
                    "shared": compiled.metadata.shared,
                    "wgmma": "wgmma.mma_async" in ptx,
                    "tma": "cp.async.bulk.tensor" in ptx,
                    "setmaxnreg": sorted(set(re.findall(SETMAXNREG, ptx))),
                    "cubin_bytes": len(compiled.asm["cubin"]),
                    "wgmma_serialized": wgmma_serialized(ptx, ptxas),
                    "newer_ptxas": newer,
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1:])
