"""Triton kernels of the dense path: the elementwise work between a layer's matmuls (GPU; CPU under
``TRITON_INTERPRET=1``).

Each kernel does in one pass over memory what the torch path of ``prefixserve.model.fused`` does in
several small ops: on an H200 those ops were about a third of a decode step's GPU time (issue 28).
One kernel per module, with its launcher and its torch reference (the oracle of tests/kernels):

  * rms_norm: RMSNorm, with the residual add before it fused in;
  * rope: RoPE of q and k straight from the fused qkv projection, optionally writing k and v into
    their KV-cache slots in the same pass;
  * silu_mul: SiLU(gate) * up from the fused gate-up projection;
  * skinny_matmul: a linear layer over a decode step's few rows, its weight streamed near the copy
    rate (cuBLAS is used wherever it measured faster); its gated form is the next one's small case;
  * gate_up: the gate-up projection with SiLU-and-mul in its epilogue ([T, 2I] never written);
  * peer_norm: at two ranks, the all-reduce of a row-parallel product (the peer's read over NVLink)
    with the residual add and RMSNorm after it;
  * ranks_norm: the same at three to eight ranks for a few rows, every rank's product read (its
    row-end is peer_norm's);
  * embedding: a vocabulary shard's lookups written where the ranks' sum reads them;
  * peer_argmax: at two ranks, the sharded argmax's exchange of each row's best column;
  * fused_moe: a mixture of experts' routing, grouping by expert, two grouped GEMMs and combine;
  * fp8_matmul: a linear layer over FP8 (e4m3) weights at a decode step's rows, and the per-token
    quantization of its input, whose rule (``e4m3``) RMSNorm and SiLU-and-mul also apply when an
    FP8 projection follows them.

The activation is one jit function (``silu_mul.silu_mul``) that the elementwise kernel and both
matmul epilogues call; gate_up also takes the skinny kernel; ranks_norm takes peer_norm's waits
and row-end; the other modules stand alone.
Triton is optional, as for the attention kernels: the modules load it through ``require_triton`` and
are imported only when a CUDA tensor takes the fused path, so ``import prefixserve`` never needs it.
docs/kernels.md ("Dense path") says how they work.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "add_rms_norm": "rms_norm",
    "add_rms_norm_ref": "rms_norm",
    "rope_qkv": "rope",
    "rope_qkv_ref": "rope",
    "silu_and_mul": "silu_mul",
    "silu_and_mul_ref": "silu_mul",
    "skinny_linear": "skinny_matmul",
    "gate_up_silu": "gate_up",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
