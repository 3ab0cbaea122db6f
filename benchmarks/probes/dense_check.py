"""Do the dense-path Triton kernels agree with the torch path at a real model's shapes (GPU, bf16)?

tests/kernels/test_dense_kernels.py checks each kernel at tiny sizes and tests/test_fused_model.py
the whole model at tiny sizes (both run on a GPU too). This probe runs the real shapes (default
dummy Llama-3.1-8B, bf16): each kernel against its torch reference at 1, 64, 1024 and 8192 tokens,
then the model's forward with the kernels on against the same forward with them off
(``fused.triton_kernels(False)``), attention skipped (``none``) so that 8192 tokens fit, and the KV
both wrote. Relative L2 errors; bf16 rounding alone gives ~4e-3 per op. Exits 1 if a kernel is over
2e-2 or the model over 5e-2 (rounding differences compound over the layers).

    PYTHONPATH=. python -m benchmarks.probes.dense_check [--model dummy:llama-3.1-8b]
    # smoke on a CPU (interpreter, fp32; the model's forward takes the torch path both times):
    TRITON_INTERPRET=1 PYTHONPATH=. python -m benchmarks.probes.dense_check --model dummy:PATH \
        --device cpu --dtype float32 --tokens 1 7
"""

from __future__ import annotations

import argparse
import sys

import torch

from prefixserve.attention.backend import make_backend
from prefixserve.attention.metadata import build_metadata
from prefixserve.kv.cache import KVCache
from prefixserve.model import fused
from prefixserve.model.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from prefixserve.model.kernels.rope import rope_qkv, rope_qkv_ref
from prefixserve.model.kernels.silu_mul import silu_and_mul, silu_and_mul_ref
from prefixserve.model.loader import load_model, resolve_model

TOKENS = (1, 64, 1024, 8192)
KERNEL_LIMIT, MODEL_LIMIT = 2e-2, 5e-2
BLOCK = 16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")


@torch.inference_mode()
def kernels(model: torch.nn.Module, tokens: int, gen: torch.Generator) -> dict[str, float]:
    cfg = model.config
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = torch.randn(tokens, cfg.hidden_size, generator=gen).to(dev, dtype)
    res = torch.randn(tokens, cfg.hidden_size, generator=gen).to(dev, dtype)
    w = model.model.layers[0].input_layernorm.weight
    out = {}
    got, got_sum = add_rms_norm(x, w, cfg.rms_norm_eps, res)
    ref, ref_sum = add_rms_norm_ref(x, w, cfg.rms_norm_eps, res)
    out["rms_norm"] = max(rel(got, ref), rel(got_sum, ref_sum))
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dev, dtype)
    positions = torch.randint(0, cfg.max_position_embeddings, (tokens,), generator=gen).to(dev)
    cos, sin = model.rotary.cos_sin(positions)
    blocks = -(-tokens // BLOCK) + 1
    caches = [torch.zeros(blocks, BLOCK, hkv, d, device=dev, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:tokens].to(dev)
    got = rope_qkv(qkv, cos, sin, hq, hkv, d, (caches[0], caches[1], slots))
    ref = rope_qkv_ref(qkv, cos, sin, hq, hkv, d, (caches[2], caches[3], slots))
    out["rope"] = max(rel(got[0], ref[0]), rel(got[1], ref[1]), rel(caches[0], caches[2]))
    out["rope_v_exact"] = float(not torch.equal(caches[1], caches[3]))
    gate_up = (2 * torch.randn(tokens, 2 * cfg.intermediate_size, generator=gen)).to(dev, dtype)
    out["silu_mul"] = rel(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    return out


@torch.inference_mode()
def forward(model: torch.nn.Module, tokens: int, gen: torch.Generator) -> dict[str, float]:
    """The model (attention skipped) with the kernels on and off: final hidden states and written KV."""
    cfg, dev = model.config, model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen).to(dev)
    positions = torch.arange(tokens, device=dev)
    blocks = -(-tokens // BLOCK)
    meta = build_metadata(BLOCK, [tokens], [tokens], [list(range(blocks))], dev)
    backend = make_backend("none")
    backend.prepare(meta)
    outs = []
    for enabled in (True, False):
        kv = KVCache(cfg, blocks, BLOCK, dtype, dev)
        with fused.triton_kernels(enabled):
            hidden = model(ids, positions, kv.layers, meta, backend)
        outs.append((hidden, kv.tensor))
    (h1, kv1), (h2, kv2) = outs
    return {"hidden": rel(h1, h2), "kv": rel(kv1, kv2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(resolve_model(args.model), dtype, torch.device(args.device), progress=False)
    gen = torch.Generator().manual_seed(0)
    worst_kernel = worst_model = 0.0
    print("| tokens | rms_norm | rope | rope v exact | silu_mul | model hidden | model KV |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in args.tokens:
        k = kernels(model, t, gen)
        f = forward(model, t, gen)
        worst_kernel = max(worst_kernel, k["rms_norm"], k["rope"], k["silu_mul"], k["rope_v_exact"])
        worst_model = max(worst_model, f["hidden"], f["kv"])
        print(
            f"| {t} | {k['rms_norm']:.1e} | {k['rope']:.1e} | {'yes' if not k['rope_v_exact'] else 'NO'} | "
            f"{k['silu_mul']:.1e} | {f['hidden']:.1e} | {f['kv']:.1e} |",
            flush=True,
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()
    ok = worst_kernel <= KERNEL_LIMIT and worst_model <= MODEL_LIMIT
    print(
        f"worst relative error: kernels {worst_kernel:.1e} (limit {KERNEL_LIMIT:.0e}), model "
        f"{worst_model:.1e} (limit {MODEL_LIMIT:.0e}): {'ok' if ok else 'FAILED'}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
