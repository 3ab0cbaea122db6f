"""Compile a Triton kernel for sm_90 with Triton's own compiler, no GPU needed (probes reading its PTX,
tests that the real compiler takes what the interpreter let through)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def compile_for_sm90(
    kernel: Any,
    types: dict[str, str],
    consts: dict[str, object],
    aligned: Iterable[str] = (),
    **options: Any,
) -> Any:
    """``kernel`` compiled for sm_90: argument types by name (others ``i32``), constexprs by name,
    ``aligned`` arguments declared 16-byte divisible as Triton's launcher specializes aligned pointers
    and strides (without it nothing is vectorized or copied asynchronously); ``options`` as
    ``triton.compile``'s (default ``num_warps=4``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(c),): v for c, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})


__all__ = ["compile_for_sm90"]
