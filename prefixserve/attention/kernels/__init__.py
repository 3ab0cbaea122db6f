"""Triton and Gluon kernels for attention over the paged KV cache (GPU; CPU under ``TRITON_INTERPRET=1``).

Every module here defines a kernel (``@triton.jit`` / ``@gluon.jit``) with its launch wrapper and, where
it has one, its torch reference. Host work lives elsewhere: the plans and rules the wrappers take in
``attention/planning/`` (work lists, tile choices, when to mix), the backends that run a step's
launches in ``attention/`` (``triton_backend.py``, ``graph_attention.py``, ``step_launch.py``).

Triton is optional: ``import prefixserve`` never needs it. The kernel modules import it through
``prefixserve.triton_support.require_triton`` so that a missing install fails on first use with a
message that says what to do. The public functions are loaded lazily from their modules (PEP 562) for
the same reason.

  * attend: Triton device blocks (softmax step, products, paged KV walk);  merge: the LSE merge kernel;
  * packed_decode, paged_attention: the paged kernels (several decode sequences a program; any step);
  * shared_attention: the Triton shared-segment kernel (``planning/shared_plan.py``'s work list);
  * gluon_attend: Gluon blocks of the Hopper ring pipeline;  shared_gluon: the Gluon shared kernel;
  * shared_gluon_fp8: the Gluon shared kernel's products on FP8 tensor cores (an e4m3 cache);
  * mixed_own: the mixed kernel's own tiles;  mixed_gluon: the mixed kernel (shared and own tiles in
    one launch; ``planning/mixed_rule.py`` says when);
  * window_attention: a sliding-window layer's attention (each row within its window; a decode step's
    segments inside the windows through the shared kernel);
  * turn: an FP8 KV cache's Hadamard turn of a head (the RoPE kernel's K store; q and its fold).

Imports go one way, down the order the ``prefixserve.attention`` docstring gives
(tests/kernels/test_kernel_imports.py checks it).

docs/kernels.md explains the kernels and every choice, with the variants that lost and the last
commit that had each; "docs/kernels.md §N" in comments names its section.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "paged_attention": "paged_attention",
    "paged_attention_ref": "paged_attention",
    "shared_segment_attention": "shared_attention",
    "shared_segment_attention_ref": "shared_attention",
    "merge_partials": "merge",
    "merge_partials_ref": "merge",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
