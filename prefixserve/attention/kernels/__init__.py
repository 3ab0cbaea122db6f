"""Triton kernels for attention over the paged KV cache (GPU; CPU under ``TRITON_INTERPRET=1``).

Triton is optional: ``import prefixserve`` never needs it. The kernel modules import it through
``prefixserve.triton_support.require_triton`` so that a missing install fails on first use with a
message that says what to do. The public functions are loaded lazily from their modules (PEP 562) for
the same reason.

One kernel (with its launcher and its torch reference) per module, host planning apart from device
code. Imports go one way, down this order (a module imports only modules before it; function-level
imports included; tests/kernels/test_kernel_imports.py checks it):

    _ptxas < merge < tiles < attend < packed_decode < paged_attention < gluon_attend
    < shared_gluon < shared_plan < shared_attention < mixed_rule < mixed_own < mixed_gluon
    < step_plan < step_launch < window_attention < graph_attention < triton_backend

  * _ptxas: the ptxas that builds the mixed kernel (recorded launches: ``prefixserve.triton_support``);
  * merge: the LSE merge kernel;  tiles: host checks, shared-memory tile fitting, fitted launches;
  * attend: Triton device blocks (softmax step, products, paged KV walk);
  * packed_decode, paged_attention: the paged kernels (several decode sequences a program; any step);
  * shared_plan: the shared-segment work list (host);  shared_attention: the Triton shared kernel;
  * gluon_attend: Gluon blocks of the Hopper ring pipeline;  shared_gluon: the Gluon shared kernel;
  * window_attention: a sliding-window layer's attention (each row within its window; a decode step's
    segments inside the windows through the shared kernel);
  * mixed_rule: when a decode step takes the mixed kernel (host);  mixed_own: its own tiles;
    mixed_gluon: the mixed kernel (shared and own tiles in one launch);
  * step_plan, step_launch: a step's host plan and launch paths, shared by the eager backend and the
    decode graphs;  graph_attention: the decode graphs' attention;  triton_backend: the backends.

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
    "TritonBackend": "triton_backend",
    "TritonPagedBackend": "triton_backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
