"""Does a projection that feeds a norm run faster as K-sliced fp32 partials the norm sums?

cuBLAS splits K for Llama-3.1-8B's down projection at decode sizes where its tiles leave SMs idle
(a kernel profile at 256 rows: ``splitKreduce_kernel`` after every down GEMM, 0.16 ms a step). The
alternative (``fused.split_k_matmul``): one strided batched matmul over S slices of K writes fp32
partials, and the next RMSNorm (``add_rms_norm`` with [S, T, N] input) sums them: no reduce kernel.
Each pair (projection, then the add-RMSNorm with a residual) is timed as a CUDA graph over weight
copies that do not fit L2, against the fp32 reference; ``--lt`` also times cuBLASLt as torch's
backend; ``--profile`` lists the kernels each form launches; ``--engine-ab N`` runs whole decode
steps (``step_modes``-style, a fresh engine each) with ``fused.SPLIT_K_ROWS`` on and off, N rounds.

``--qkv`` times the attention's qkv projection the same way, paired with the RoPE kernel that
writes K/V to the cache (``fused.qkv_partials``: that kernel sums the partials), at Llama-3.1-8B's
and 70B's tensor-parallel shards.

PYTHONPATH=. python -m benchmarks.probes.split_k --rows 128 256 512 1024 --profile --engine-ab 2
PYTHONPATH=. python -m benchmarks.probes.split_k --qkv qkv8b_tp2 qkv8b_tp1 --rows 64 128 256 --splits 2 4
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.harness.timing import cold_weights, graph_ms
from prefixserve.model import fused
from prefixserve.model.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from prefixserve.model.kernels.rope import rope_qkv, rope_qkv_ref

HIDDEN, INTER, EPS = 4096, 14336, 1e-5
PROJECTIONS = {"down": (HIDDEN, INTER), "o": (HIDDEN, HIDDEN)}  # N, K
SPLITS = (2, 3, 4, 7, 8)
HEAD_DIM = 128
# the qkv projection's shards: (query heads, KV heads, K) a rank
QKV = {
    "qkv8b_tp1": (32, 8, 4096),
    "qkv8b_tp2": (16, 4, 4096),
    "qkv8b_tp4": (8, 2, 4096),
    "qkv70b_tp1": (64, 8, 8192),
    "qkv70b_tp2": (32, 4, 8192),
    "qkv70b_tp4": (16, 2, 8192),
}


def pair_forms(k: int, splits: tuple[int, ...]) -> list[tuple[str, int]]:
    """(name, splits) of each form: 0 is F.linear then the norm."""
    return [("linear", 0)] + [(f"split{s}", s) for s in splits if k % (s * 64) == 0]


def run_pair(x, w, nw, res, splits):
    y = fused.split_k_matmul(x, w, splits) if splits else F.linear(x, w)
    return add_rms_norm(y, nw, EPS, res)


def sweep(names: list[str], rows: list[int], splits: tuple[int, ...], lt: bool) -> list[dict]:
    out = []
    for name in names:
        out += sweep_projection(name, *PROJECTIONS[name], rows, splits, lt)
    return out


def sweep_projection(
    name: str, n: int, k: int, rows: list[int], splits: tuple[int, ...], lt: bool
) -> list[dict]:
    forms = pair_forms(k, splits)
    dev = torch.device("cuda")
    ws = cold_weights(n, k, 1 / 64)
    nw = torch.rand(n, device=dev, dtype=torch.bfloat16) + 0.5
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        exact = F.linear(x.double(), ws[0].double())
        ref_sum = add_rms_norm_ref(exact, nw.double(), EPS, res.double())[1]

        def timed(s: int, x=x, res=res) -> float:
            return 1e3 * graph_ms(lambda i: run_pair(x, ws[i], nw, res, s), len(ws))

        row = {"proj": name, "rows": m}
        for form, s in forms:
            got_sum = run_pair(x, ws[0], nw, res, s)[1]
            row[f"{form}_err"] = float((got_sum.double() - ref_sum).abs().max() / ref_sum.abs().max())
            row[form] = timed(s)
        if lt:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                row["linear_lt"] = timed(0)
            finally:
                torch.backends.cuda.preferred_blas_library("default")
        best = min((f for f, _ in forms if f != "linear"), key=lambda f: row[f])
        row["best"] = best
        print(
            f"{name:>5} {m:5d} rows: linear {row['linear']:7.1f} us"
            + (f", lt {row['linear_lt']:7.1f}" if lt else "")
            + "".join(f", {f} {row[f]:7.1f}" for f, _ in forms if f != "linear")
            + f"  (best {best}: {row['linear'] / row[best]:.3f}x; err {row[best + '_err']:.1e}"
            f" vs {row['linear_err']:.1e})",
            flush=True,
        )
        out.append(row)
    return out


def run_qkv(x, w, rope, heads, kv_heads, cache, splits):
    qkv = fused.split_k_matmul(x, w, splits) if splits else fused.linear(x, w)
    return rope_qkv(qkv, *rope, heads, kv_heads, HEAD_DIM, cache, x.dtype)


def sweep_qkv(names: list[str], rows: list[int], splits: tuple[int, ...]) -> list[dict]:
    """The qkv projection then RoPE with the K/V cache write, one matmul against K slices."""
    out = []
    for name in names:
        heads, kv_heads, k = QKV[name]
        n = (heads + 2 * kv_heads) * HEAD_DIM
        ws = cold_weights(n, k, 1 / 64)
        for m in rows:
            row = {"proj": name, "rows": m, "n": n, "k": k}
            row.update(qkv_point(ws, m, heads, kv_heads, pair_forms(k, splits)))
            forms = [f for f, _ in pair_forms(k, splits)]
            print(
                f"{name:>11} {m:5d} rows: linear + rope {row['linear']:6.1f} us"
                + "".join(f", {f} {row[f]:6.1f}" for f in forms[1:])
                + f"  (best {row['best']}: {row['linear'] / row[row['best']]:.3f}x;"
                f" err {row[row['best'] + '_err']:.1e} vs {row['linear_err']:.1e})",
                flush=True,
            )
            out.append(row)
        del ws
        torch.cuda.empty_cache()
    return out


def qkv_point(
    ws: list[torch.Tensor], m: int, heads: int, kv_heads: int, forms: list[tuple[str, int]]
) -> dict:
    """Each form's us a call and its q's largest error (against the fp64 product rounded once)."""
    dev = ws[0].device
    x = torch.randn(m, ws[0].shape[1], device=dev, dtype=torch.bfloat16)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
    rope = fused.rope_cos_sin(torch.arange(m, device=dev) * 7, inv_freq)
    caches = [torch.zeros(m, kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    cache = (*caches, torch.arange(m, device=dev))
    exact = F.linear(x.double(), ws[0].double()).to(torch.bfloat16)
    ref_q = rope_qkv_ref(exact, *rope, heads, kv_heads, HEAD_DIM)[0].float()
    row: dict = {}
    for form, s in forms:
        got = run_qkv(x, ws[0], rope, heads, kv_heads, cache, s)[0].float()
        row[f"{form}_err"] = float((got - ref_q).abs().max() / ref_q.abs().max())
        row[form] = 1e3 * graph_ms(lambda i, s=s: run_qkv(x, ws[i], rope, heads, kv_heads, cache, s), len(ws))
    row["best"] = min((f for f, _ in forms if f != "linear"), key=lambda f: row[f])
    return row


def profile(m: int, splits: tuple[int, ...]) -> dict:
    """Kernel names and times of the down pair at ``m`` rows, linear vs the 4-way split."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev = torch.device("cuda")
    n, k = PROJECTIONS["down"]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
    nw = torch.ones(n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    found = {}
    for form, s in pair_forms(k, splits):
        for _ in range(3):
            run_pair(x, w, nw, res, s)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run_pair(x, w, nw, res, s)
            torch.cuda.synchronize()
        kernels = {
            e.key[:90]: round(e.device_time_total / 10, 2)
            for e in prof.key_averages()
            if e.device_time_total > 0 and e.key[:90]
        }
        found[form] = kernels
        print(f"down {m} rows, {form}: " + "; ".join(f"{k} {v} us" for k, v in kernels.items()), flush=True)
    return found


def engine_ab(points: list[str], rounds: int) -> list[dict]:
    """Whole decode runs (a fresh engine each), ``fused.SPLIT_K_ROWS``'s rule on and off in turn."""
    from benchmarks.decode_run import measure, shared_prompts

    out = []
    for point in points:
        b, p = (int(v) for v in point.split("x"))
        prompts = (shared_prompts(b, p, 64, seed=0), shared_prompts(b, p, 64, seed=1))
        for r in range(rounds):
            for mode in ("rule", "off"):
                with fused.split_k_products(mode == "rule"):
                    res = measure("dummy:llama-3.1-8b", "cuda", "auto", prompts, 128)
                step = 1e3 * b / res["tok_s"]
                out.append({"B": b, "P": p, "round": r, "mode": mode, "tok_s": res["tok_s"], "step_ms": step})
                print(f"B={b} P={p} round {r} {mode:>4}: {res['tok_s']:9.0f} tok/s {step:.3f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 192, 256, 384, 512, 1024])
    ap.add_argument("--lt", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="rows to profile the down pair at (0: none)")
    ap.add_argument("--engine-ab", type=int, default=0)
    ap.add_argument("--points", nargs="+", default=["256x16384"])
    ap.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    ap.add_argument("--splits", nargs="+", type=int, default=list(SPLITS))
    ap.add_argument("--qkv", nargs="*", default=[], choices=list(QKV), help="qkv + RoPE pairs instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.profile:
        result["profile"] = profile(args.profile, tuple(args.splits))
    if args.qkv:
        result["qkv"] = sweep_qkv(args.qkv, args.rows, tuple(args.splits))
    else:
        result["sweep"] = sweep(args.projections, args.rows, tuple(args.splits), args.lt)
    if args.engine_ab:
        result["engine"] = engine_ab(args.points, args.engine_ab)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
