"""Probe: a prefill step's attention through our paged kernel against ``attention/dense_prefill.py``
(SDPA: cuDNN's kernel, FlashAttention-2's after context), at the Llama-3.1-8B and 70B heads, for
single prompts of 512-8,192 tokens, chunks after context and four prompts at once; ``--backends``:
one 8,192-token causal prefill through each of torch's SDPA kernels alone (flash, cuDNN,
memory-efficient) beside ours. us, TFLOP/s (causal), and the outputs' largest difference.

    PYTHONPATH=. python -m benchmarks.probes.dense_prefill [--backends] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.timing import bench_ms
from prefixserve.attention import dense_prefill
from prefixserve.attention.kernels.paged_attention import paged_attention
from prefixserve.attention.metadata import build_metadata

BS, KV_HEADS, DIM = 16, 8, 128
STEPS = [  # (query rows, KV tokens) of each sequence of a step
    ([512], [512]),
    ([1024], [1024]),
    ([2048], [2048]),
    ([4096], [4096]),
    ([8192], [8192]),
    ([2048], [8192]),
    ([8192], [16384]),
    ([1024] * 4, [1024] * 4),
    ([2048] * 4, [2048] * 4),
]


def _step(q_lens: list[int], seq_lens: list[int], q_heads: int):
    gen = torch.Generator().manual_seed(0)
    blocks = sum(-(-s // BS) for s in seq_lens)
    k = torch.randn(blocks, BS, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    perm, tables, at = torch.randperm(blocks, generator=gen).tolist(), [], 0
    for s in seq_lens:
        tables.append(perm[at : at + -(-s // BS)])
        at += -(-s // BS)
    meta = build_metadata(BS, q_lens, seq_lens, tables, torch.device("cuda"))
    q = torch.randn(sum(q_lens), q_heads, DIM, dtype=torch.bfloat16, device="cuda")
    return q, k, v, meta


def _flops(q_lens: list[int], seq_lens: list[int], q_heads: int) -> float:
    return sum(4 * ql * (sl - ql / 2) * DIM * q_heads for ql, sl in zip(q_lens, seq_lens, strict=True))


def _ours(q, k, v, meta, scale: float):
    """Our paged kernel over the step (what the backend ran before ``dense_prefill``)."""
    q_len, kv_len = max(meta.query_lens_host), max(meta.seq_lens_host)
    lens = (meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, q_len)
    return lambda: paged_attention(q, k, v, *lens, max_seq_len=kv_len)[0]


def _dense(q, k, v, meta, scale: float):
    """The step through ``dense_prefill.attend``."""
    seqs = dense_prefill.plan(meta) or ()
    return lambda: dense_prefill.attend(q, k, v, meta, seqs, scale, torch.empty_like(q))


def _sdpa(q, k, v, backend, scale: float):
    """One sequence's causal attention through one SDPA kernel alone (KV contiguous)."""
    from torch.nn.attention import sdpa_kernel

    n = q.shape[0]
    qs = q.transpose(0, 1)[None]
    ks, vs = (c.reshape(n, KV_HEADS, DIM).transpose(0, 1)[None].contiguous() for c in (k, v))

    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    return run


def steps() -> list[dict]:
    rows = []
    scale = 1 / math.sqrt(DIM)
    old_min_rows = dense_prefill.MIN_ROWS
    dense_prefill.MIN_ROWS = 1  # every step of the grid planned for the dense path
    try:
        for q_heads in (32, 64):
            for q_lens, seq_lens in STEPS:
                q, k, v, meta = _step(q_lens, seq_lens, q_heads)
                ours, dense = _ours(q, k, v, meta, scale), _dense(q, k, v, meta, scale)
                r = {"hq": q_heads, "q_lens": q_lens, "seq_lens": seq_lens}
                r["max_abs_diff"] = float((ours().float() - dense().float()).abs().max())
                r["ours_ms"], r["dense_ms"] = bench_ms(ours), bench_ms(dense)
                flops = _flops(q_lens, seq_lens, q_heads)
                r["ours_TFLOPs"], r["dense_TFLOPs"] = flops / r["ours_ms"] / 1e9, flops / r["dense_ms"] / 1e9
                r["dense_over_ours"] = r["dense_ms"] / r["ours_ms"]
                rows.append(r)
                print(
                    f"hq={q_heads} q={q_lens} kv={seq_lens}: ours {r['ours_ms']:.3f} ms, dense "
                    f"{r['dense_ms']:.3f} ms ({r['dense_over_ours']:.2f}x), diff {r['max_abs_diff']:.1e}",
                    flush=True,
                )
    finally:
        dense_prefill.MIN_ROWS = old_min_rows
    return rows


def backends() -> list[dict]:
    """One 8,192-token causal prefill through each SDPA kernel alone, and ours."""
    from torch.nn.attention import SDPBackend

    rows, n, scale = [], 8192, 1 / math.sqrt(DIM)
    kernels = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for q_heads in (32, 64):
        q, k, v, meta = _step([n], [n], q_heads)
        ours = _ours(q, k, v, meta, scale)
        mine = ours().float()
        row = {"hq": q_heads, "n": n, "ours_ms": bench_ms(ours)}
        for name, backend in kernels.items():
            run = _sdpa(q, k, v, backend, scale)
            try:
                row[name + "_err"] = float((run().float() - mine).abs().max())
                row[name + "_ms"] = bench_ms(run)
            except RuntimeError as exc:  # no kernel of this kind for the shape
                row[name + "_error"] = repr(exc)[:200]
        flops = _flops([n], [n], q_heads)
        for key in [key for key in row if key.endswith("_ms")]:
            row[key[:-3] + "_TFLOPs"] = flops / row[key] / 1e9
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", action="store_true", help="each SDPA kernel alone at 8,192 tokens")
    ap.add_argument("--out", default="/tmp/dense_prefill")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "prefill_attn_backends.json" if args.backends else "dense_prefill_probe.json"
    (out / name).write_text(json.dumps(backends() if args.backends else steps(), indent=1))


if __name__ == "__main__":
    main()
