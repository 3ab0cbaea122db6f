"""Decode attention with a shared prefix: prefixserve's kernels vs torch baselines vs the roofline.

One decode-attention call, 32 query heads, 8 KV heads, d=128, bf16, block size 16; every sequence holds
a shared prefix of P tokens and an own suffix of S tokens. Grid B x P x S. Columns (one run):
  shared_ms       prefixserve "triton" backend (shared-segment kernel + own paged kernel + LSE merge),
                  the prefix in consecutive blocks, as a fresh pool hands out a prompt's blocks (TMA loads)
  shared_scattered_ms  the same with the prefix blocks scattered over the pool (pointer-gather loads)
  paged_ms        prefixserve "triton_paged" (same paged kernel over whole tables, no sharing)
  baseline_ms     torch flash attention over a materialised per-sequence KV (null if it does not fit)
  torch_paper_ms  Hydragen/RelayAttention in PyTorch: prefix attention with stacked queries + suffix
                  attention (each aten._scaled_dot_product_flash_attention, which returns the LSE) + merge
  roofline_ms     T* = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both measured in the run
Plan building (host: make_plan + work list) is timed apart (plan_ms).

Usage:
  PYTHONPATH=. python benchmarks/attention.py run [--out DIR] [--quick] [--tune]   # on a GPU
  python benchmarks/attention.py report --json FILE [--out DIR]      # md + png from a JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.attention_grid import BASELINE_CAP_BYTES, BS, GRID_B, GRID_P, GRID_S, HKV, HQ, D
from benchmarks.attention_report import report
from benchmarks.harness import RESULTS, run_info, run_or_report
from benchmarks.harness.timing import bench_ms, graphed, measure_ceilings, time_launches


class Case:
    """One (B, P, S) point: a paged cache, block tables, metadata and the torch baselines' layouts."""

    def __init__(
        self,
        batch: int,
        prefix: int,
        suffix: int,
        device: torch.device,
        seed: int = 0,
        scattered_prefix: bool = False,
        heads: tuple[int, int] = (HQ, HKV),
    ) -> None:
        from prefixserve.attention.metadata import build_metadata

        g = torch.Generator(device="cpu").manual_seed(seed)
        self.B, self.P, self.S = batch, prefix, suffix
        self.hq, self.hkv = heads  # query and KV heads (default: the grid's model)
        n_p, n_s = prefix // BS, suffix // BS
        num_blocks = n_p + batch * n_s
        self.k_cache = torch.randn(num_blocks, BS, self.hkv, D, device=device, dtype=torch.bfloat16)
        self.v_cache = torch.randn(num_blocks, BS, self.hkv, D, device=device, dtype=torch.bfloat16)
        # the prefix in consecutive blocks (a prompt's blocks from a fresh pool), or scattered; the
        # suffix blocks (allocated a decode step at a time) are always scattered
        perm = torch.randperm(num_blocks, generator=g)
        if not scattered_prefix:
            perm = torch.cat([torch.arange(n_p), n_p + torch.randperm(num_blocks - n_p, generator=g)])
        self.prefix_blocks = perm[:n_p]
        self.suffix_blocks = perm[n_p:].view(batch, n_s)
        tables = torch.cat([self.prefix_blocks.expand(batch, n_p), self.suffix_blocks], 1).tolist()
        self.meta = build_metadata(BS, [1] * batch, [prefix + suffix] * batch, tables, device)
        self.q = torch.randn(batch, self.hq, D, device=device, dtype=torch.bfloat16)
        self.scale = 1.0 / math.sqrt(D)

    def kv_bytes(self) -> int:
        return (self.P + self.B * self.S) * self.hkv * D * 2 * 2

    def roofline(self, copy_tbps: float, gemm_tflops: float) -> tuple[float, float]:
        """(bytes_ms, flops_ms) for the minimal traffic and the attention FLOPs."""
        nbytes = self.kv_bytes() + 2 * self.B * self.hq * D * 2
        flops = 4 * self.hq * D * self.B * (self.P + self.S)
        return nbytes / (copy_tbps * 1e12) * 1e3, flops / (gemm_tflops * 1e12) * 1e3

    # --- prefixserve -------------------------------------------------------------------------------
    def backend(self, name: str, overlap: bool = False) -> tuple[Any, float]:
        """(forward closure, host plan ms) for a prefixserve backend (``backend_fn``)."""
        return backend_fn(name, self.q, self.k_cache, self.v_cache, self.meta, self.scale, overlap)

    def parts(self) -> dict[str, float]:
        """The shared path's launches (shared kernel, own kernel, merge; or mixed kernel, merge) each
        timed alone."""
        from prefixserve.attention.triton_backend import TritonBackend

        be = TritonBackend()
        be.overlap_min_rows = 0
        meta = dataclasses.replace(self.meta, plan=None, stats={})
        be.prepare(meta)
        be.forward(self.q, self.k_cache, self.v_cache, meta, self.scale)
        lay = next(iter(meta.plan.layouts.values()))
        parts = time_launches(lay.launches, (self.q, self.k_cache, self.v_cache, torch.empty_like(self.q)))
        return parts

    # --- torch baselines ---------------------------------------------------------------------------
    def materialised(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-sequence contiguous KV [B, Hkv, P+S, D] (None when it would not fit the cap)."""
        n = self.P + self.S
        if self.B * n * self.hkv * D * 2 * 2 > BASELINE_CAP_BYTES:
            return None
        idx = torch.cat([self.prefix_blocks.expand(self.B, -1), self.suffix_blocks], 1).to(self.q.device)
        k = self.k_cache[idx].reshape(self.B, n, self.hkv, D).transpose(1, 2)
        v = self.v_cache[idx].reshape(self.B, n, self.hkv, D).transpose(1, 2)
        return k, v

    def baseline_fn(self, kv: tuple[torch.Tensor, torch.Tensor]):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        k, v = kv
        q4 = self.q.view(self.B, self.hkv, self.hq // self.hkv, D)  # a KV head's G heads: G query rows

        def run() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=self.scale)
            return o.reshape(self.B, self.hq, D)

        return run

    def paper_fn(self):
        """Prefix once with all B x G queries stacked, suffix per sequence, LSE merge (torch ops)."""
        b, g, hkv = self.B, self.hq // self.hkv, self.hkv
        kp = self.k_cache[self.prefix_blocks.to(self.q.device)].reshape(1, self.P, hkv, D).transpose(1, 2)
        vp = self.v_cache[self.prefix_blocks.to(self.q.device)].reshape(1, self.P, hkv, D).transpose(1, 2)
        sb = self.suffix_blocks.to(self.q.device)
        ks = self.k_cache[sb].reshape(b, self.S, self.hkv, D).transpose(1, 2)
        vs = self.v_cache[sb].reshape(b, self.S, self.hkv, D).transpose(1, 2)
        flash = torch.ops.aten._scaled_dot_product_flash_attention

        def run() -> torch.Tensor:
            qp = self.q.view(b, self.hkv, g, D).transpose(0, 1).reshape(1, self.hkv, b * g, D)
            op, lp = flash(qp, kp, vp, scale=self.scale)[:2]  # [1, Hkv, B*G, D], [1, Hkv, B*G]
            os_, ls = flash(self.q.view(b, hkv, g, D), ks, vs, scale=self.scale)[:2]  # [B, Hkv, G, *]
            op = op.view(self.hkv, b, g, D).transpose(0, 1)
            lp = lp.view(self.hkv, b, g).transpose(0, 1)
            m = torch.maximum(lp, ls)
            wp, ws = torch.exp(lp - m)[..., None], torch.exp(ls - m)[..., None]
            return ((op.float() * wp + os_.float() * ws) / (wp + ws)).to(self.q.dtype).reshape(b, self.hq, D)

        return run

    def reference64(self) -> torch.Tensor:
        """fp64 attention over each sequence's whole KV: [B, Hq, D]."""
        outs = []
        for lo in range(0, self.B, 16):
            hi = min(self.B, lo + 16)
            idx = torch.cat([self.prefix_blocks.expand(hi - lo, -1), self.suffix_blocks[lo:hi]], 1)
            idx = idx.to(self.q.device)
            k = self.k_cache[idx].reshape(hi - lo, -1, self.hkv, D).double()
            v = self.v_cache[idx].reshape(hi - lo, -1, self.hkv, D).double()
            q = self.q[lo:hi].double().view(hi - lo, self.hkv, self.hq // self.hkv, D)
            s = torch.einsum("bhgd,bnhd->bhgn", q, k) * self.scale
            outs.append(torch.einsum("bhgn,bnhd->bhgd", s.softmax(-1), v).reshape(hi - lo, self.hq, D))
        return torch.cat(outs)


def backend_fn(
    name: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    scale: float,
    overlap: bool = False,
) -> tuple[Any, float]:
    """(forward closure, host plan ms) for the prefixserve backend ``name`` over one paged batch.

    ``overlap=True`` runs the shared kernel on a side stream at every batch size, as the engine's
    CUDA-graph path does (in a graph the fork costs no host time); the eager backend forks only
    from 512 stacked rows. Shared by ``peers_gpu.py``.
    """
    from prefixserve.attention.triton_backend import (
        TritonBackend,
        TritonPagedBackend,
        build_layout,
    )

    cls = TritonBackend if name == "triton" else TritonPagedBackend
    be = cls()
    if overlap:
        be.overlap_min_rows = 0
    meta = dataclasses.replace(meta, plan=None, stats={})  # each backend its own plan
    hq, hkv, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    times = []
    for _ in range(5):  # host plan: make_plan + work list + merge CSR + buffers (kernels excluded)
        t0 = time.perf_counter()
        be.prepare(meta)
        if name == "triton" and meta.plan.shared is not None:
            key = (hq, hkv, dim, str(q.device), str(q.dtype), False)  # no LSE kept
            meta.plan.layouts[key] = build_layout(meta, meta.plan, hq, hkv, dim, q.device, q.dtype)
        _sync(q.device)
        times.append((time.perf_counter() - t0) * 1e3)
    plan_ms = sorted(times)[len(times) // 2]
    if name == "triton" and meta.plan.shared is not None:
        meta.plan.layouts.clear()  # the backend's forward builds its own (stream, pack choices)
    be.forward(q, k_cache, v_cache, meta, scale)  # compile
    _sync(q.device)
    return (lambda: be.forward(q, k_cache, v_cache, meta, scale)), plan_ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return float("nan")
    return float((x.double() - ref).norm() / ref.norm())


def check(device: torch.device) -> list[dict[str, Any]]:
    """Correctness at real sizes: every column against fp64; the shared path must match paged's error."""
    rows = []
    for b, p, s in ((16, 1024, 128), (64, 4096, 512), (256, 1024, 128)):
        case = Case(b, p, s, device, seed=1)
        ref = case.reference64()
        res = {"B": b, "P": p, "S": s}
        for name in ("triton", "triton_paged"):
            fn, _ = case.backend(name)
            out = fn()
            res[name] = rel_err(out, ref)
        scattered = Case(b, p, s, device, seed=1, scattered_prefix=True)
        res["triton_scattered"] = rel_err(scattered.backend("triton")[0](), scattered.reference64())
        del scattered
        res["paper"] = rel_err(case.paper_fn()(), ref)
        kv = case.materialised()
        res["baseline"] = rel_err(case.baseline_fn(kv)(), ref) if kv is not None else None
        worst = max(res["triton"], res["triton_scattered"])
        res["ok"] = worst <= 1.25 * res["triton_paged"] + 1e-4 and worst < 1e-2
        rows.append(res)
        print("check", res, flush=True)
        torch.cuda.empty_cache()
    return rows


def tune(device: torch.device) -> list[dict[str, Any]]:
    """Time kernel variants (tiles, warps, stages) of the shared and own kernels at telling points."""
    out: list[dict[str, Any]] = []
    for b, p, s in ((16, 16384, 128), (64, 4096, 512), (1024, 16384, 512)):
        out += tune_point(Case(b, p, s, device))
        torch.cuda.empty_cache()
    return out


SHARED_VARIANTS = (  # (BLOCK_M, BLOCK_N, warps, stages)
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
)
SPLIT_TARGETS = (2, 4)  # programs per SM the shared work list aims at
OWN_VARIANTS = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 3), (64, 2, 3))


def tune_point(case: Case) -> list[dict[str, Any]]:
    from prefixserve.attention.kernels import paged_attention as pa
    from prefixserve.attention.kernels import shared_attention as sa
    from prefixserve.attention.planning.shared_plan import plan_shared_work
    from prefixserve.attention.triton_backend import TritonBackend

    device, b, tokens = case.q.device, case.B, case.B
    TritonBackend().prepare(case.meta)
    plan = case.meta.plan.shared
    where = {"B": case.B, "P": case.P, "S": case.S}
    out = []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for (bm, bn, nw, ns), per_sm in itertools.product(SHARED_VARIANTS, SPLIT_TARGETS):
        if per_sm != 2 and case.B > 64:
            continue  # large B has enough M-tiles: the split target does not change its work list
        work = plan_shared_work(
            plan.seg_row_start_host,
            [case.P],
            HKV,
            HQ // HKV,
            device,
            bm,
            bn,
            target_programs=per_sm * sms,
            num_stages=ns,
        )
        o = torch.empty(work.num_slots, HQ, D, device=device)
        lse = torch.empty(work.num_slots, HQ, device=device)
        args = (case.q, case.k_cache, case.v_cache, plan.seg_blocks, plan.seg_block_start, plan.seg_rows)
        try:
            ms = bench_ms(lambda a=args, w=work, o=o, ls=lse, nw=nw, ns=ns: sa.launch_shared(
                *a, w, case.scale, o, ls, num_warps=nw, num_stages=ns))  # fmt: skip
        except Exception as exc:
            ms = repr(exc)[:100]
        cfg = [work.block_m, work.block_n, nw, work.num_stages, per_sm]
        out.append({"kernel": "shared", **where, "cfg": cfg, "ms": ms})
        print(out[-1], flush=True)
    for bn, nw, ns in OWN_VARIANTS:
        splits, size = pa.choose_split(case.S, b * HKV, device, bn)
        o = torch.empty(splits * tokens, HQ, D, device=device)
        lse = torch.empty(splits * tokens, HQ, device=device)
        args = (case.q, case.k_cache, case.v_cache, plan.own_block_tables, plan.own_seq_lens)
        try:
            ms = bench_ms(lambda a=args, o=o, ls=lse, bn=bn, nw=nw, ns=ns, sp=splits, sz=size: (
                pa.launch_paged(*a, case.meta.query_start_loc, case.scale, 1, sp, sz, o, ls, tokens * HQ * D,
                                tokens * HQ, bn, nw, ns)))  # fmt: skip
        except Exception as exc:
            ms = repr(exc)[:100]
        out.append({"kernel": "own", **where, "cfg": [bn, nw, ns, splits], "ms": ms})
        print(out[-1], flush=True)
    return out


def run(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_tbps, gemm_tflops = measure_ceilings(device)
    print(f"copy {copy_tbps:.2f} TB/s, bf16 gemm {gemm_tflops:.0f} TFLOP/s", flush=True)
    checks, tuning = [], []
    try:
        checks = check(device) if not args.no_check else []
    except Exception:
        traceback.print_exc()
    try:
        tuning = tune(device) if args.tune else []
    except Exception:
        traceback.print_exc()
    grid = [(16, 1024, 128), (1024, 16384, 512)] if args.quick else [
        (b, p, s) for b in GRID_B for p in GRID_P for s in GRID_S
    ]  # fmt: skip
    rows = []
    for b, p, s in grid:
        try:
            rows.append(measure_point(b, p, s, device, copy_tbps, gemm_tflops))
        except Exception as exc:  # keep the rest of the grid; the row says what failed
            traceback.print_exc()
            rows.append({"B": b, "P": p, "S": s, "error": repr(exc)})
        print(rows[-1], flush=True)
        (out_dir / "attention.partial.json").write_text(json.dumps(rows))
        torch.cuda.empty_cache()
    rows = [r for r in rows if "error" not in r] + [r for r in rows if "error" in r]
    _finish(rows, checks, tuning, copy_tbps, gemm_tflops, out_dir)


def measure_point(
    b: int, p: int, s: int, device: torch.device, copy_tbps: float, gemm_tflops: float
) -> dict[str, Any]:
    """Time every column at one grid point."""
    case = Case(b, p, s, device)
    shared_fn, plan_ms = case.backend("triton", overlap=True)
    paged_fn, _ = case.backend("triton_paged")
    row: dict[str, Any] = {"B": b, "P": p, "S": s}
    row["shared_ms"] = bench_ms(graphed(shared_fn))
    row["shared_ms_repeat"] = bench_ms(graphed(shared_fn))  # the noise of one build, timed twice
    row["shared_eager_ms"] = bench_ms(case.backend("triton")[0])
    scattered = Case(b, p, s, device, scattered_prefix=True)
    row["shared_scattered_ms"] = bench_ms(graphed(scattered.backend("triton", overlap=True)[0]))
    del scattered
    row["paged_ms"] = bench_ms(graphed(paged_fn))
    row["paged_eager_ms"] = bench_ms(paged_fn)
    row["torch_paper_ms"] = bench_ms(graphed(case.paper_fn()))
    kv = case.materialised()
    row["baseline_ms"] = bench_ms(graphed(case.baseline_fn(kv))) if kv is not None else None
    del kv
    row["bytes_ms"], row["flops_ms"] = case.roofline(copy_tbps, gemm_tflops)
    row["roofline_ms"] = max(row["bytes_ms"], row["flops_ms"])
    row["plan_ms"] = plan_ms
    if row["roofline_ms"] >= 0.05:  # the points the %T* targets count: where the time goes
        row["parts_ms"] = case.parts()
    return row


def _finish(
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    tuning: list[dict[str, Any]],
    copy_tbps: float,
    gemm_tflops: float,
    out_dir: Path,
) -> None:
    import triton

    device = torch.device("cuda")
    commit = run_info()["commit"]  # PREFIXSERVE_COMMIT wins: the device copy's .git may be stale
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit or "uncommitted",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "copy_bandwidth_TBps": copy_tbps,
        "gemm_TFLOPs": gemm_tflops,
        "rows": rows,
        "checks": checks,
        "tuning": tuning,
    }
    (out_dir / "attention.json").write_text(json.dumps(result, indent=1))
    report(result, out_dir)


def main() -> None:
    def add_run_args(r: argparse.ArgumentParser) -> None:
        r.add_argument("--quick", action="store_true")
        r.add_argument("--tune", action="store_true")
        r.add_argument("--no-check", action="store_true")

    run_or_report(__doc__, "attention", RESULTS, add_run_args, run, report)


if __name__ == "__main__":
    main()
