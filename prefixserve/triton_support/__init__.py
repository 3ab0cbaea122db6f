"""What every Triton kernel of the package shares: importing Triton, and recorded launches.

The model's dense kernels, the sampler's argmax and the attention kernels all need Triton imported
the same way (optional: a missing install fails on first use with the fix named) and launched
cheaply layer after layer (``launch``). This package sits below all three, so none of them imports
another's kernels for it.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

__all__ = ["require_triton", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (a GPU is still needed unless TRITON_INTERPRET=1). Asked once a
    process: every decode step's sampling asks it, and ``import_module`` took ~10-20 us a call."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def require_triton() -> tuple[Any, Any]:
    """Return ``(triton, triton.language)`` or raise ImportError naming the fix."""
    try:
        triton = importlib.import_module("triton")
        tl = importlib.import_module("triton.language")
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "prefixserve's Triton kernels need the 'triton' package: pip install 'prefixserve[triton]' "
            "(or use the 'reference' / 'cascade' attention backends, which need only torch)"
        ) from exc
    _interpreter_compat()
    return triton, tl


def _interpreter_compat() -> None:
    """Let Triton 3.x's CPU interpreter run loops with tensor bounds under NumPy >= 2.4, and take bf16
    operands in ``tl.dot`` (``_interpreter_bf16_dot``).

    The interpreter turns a scalar tensor (a 1-element array) into a Python int with ``int(array)``,
    which NumPy 2.4 refuses for arrays with ndim > 0; we patch that one conversion.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        interp = importlib.import_module("triton.runtime.interpreter")
    except ImportError:  # pragma: no cover
        return
    _interpreter_bf16_dot(interp)
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_prefixserve_compat", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._prefixserve_compat = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patched


def _interpreter_bf16_dot(interp: Any) -> None:
    """Let the interpreter's ``tl.dot`` take bf16 operands: it holds bf16 as its raw 16 bits and would
    multiply those as integers (it widens only e4m3); here they are widened to fp32 first (exact)."""
    builder = getattr(interp, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_prefixserve_compat", False):
        return
    import numpy as np

    def widened(handle: Any) -> Any:
        if handle.dtype.scalar.name != "bf16":
            return handle
        bits = np.ascontiguousarray(handle.data).view(np.uint16).astype(np.uint32) << 16
        return interp.TensorHandle(bits.view(np.float32), interp.tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        return original(self, widened(a), widened(b), d, *args)

    create_dot._prefixserve_compat = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
