"""Probe: the warp-specialised Gluon expert GEMMs (``moe_gluon``) against the persistent Triton ones on
one MoE layer (default Qwen3-30B-A3B) at 64-row blocks: every output compared bit for bit (SiLU,
the tanh GELU, gpt-oss's clamped SwiGLU with biases; uniform and skewed routings), then the layer
graphed both ways (L2 flushed between replays) and each kernel's time from the CUDA profiler.

    PYTHONPATH=. python -m benchmarks.probes.moe_gluon [--batches 512 1024 1536 2048] [--json F]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks.harness.info import git_commit
from benchmarks.harness.output import write_json
from benchmarks.harness.timing import bench_ms, graphed
from benchmarks.moe import layer_weights
from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels import fused_moe, moe_gluon
from prefixserve.model.loader import resolve_model

TILE = next(t for _, t in fused_moe.TILES if t.persistent)  # the 64-row persistent tile


def _both(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``run``'s output with the Gluon kernels off, then on."""
    moe_gluon.ENABLED = False
    plain = run()
    moe_gluon.ENABLED = True
    return plain, run()


def _kernel_us(fn: Callable[[], object], replays: int = 20) -> dict[str, float]:
    """Microseconds a replay of each CUDA kernel of ``fn`` (a graph's replay), from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us:
            out[evt.key[:40]] = round(us / replays, 2)
    return out


def check(cfg, gen: torch.Generator, w_up: torch.Tensor, w_down: torch.Tensor, b: int) -> list[dict]:
    """Bits of the layer with the Gluon kernels against the Triton ones, by activation and routing."""
    e, k, hidden = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    inter = w_down.shape[1]
    x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    up_bias = torch.randn(e * 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen)
    down_bias = torch.randn(e * hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = []
    for routing in ("uniform", "skewed"):
        logits = torch.rand(b, e, device="cuda", generator=gen)
        if routing == "skewed":  # 16 experts take every token: 8 blocks each, most experts empty
            logits[:, 16:] -= 2.0
        weights, ids = fused_moe.route(logits, k, "softmax_topk", True)
        acts = ((fused_moe.SILU, False), (fused_moe.GELU_TANH, False), (fused_moe.SWIGLU_OAI, True))
        for act, biases in acts:
            extra = {"up_bias": up_bias, "down_bias": down_bias} if biases else {}
            args = (x, w_up, w_down, weights, ids)
            plain, fast = _both(partial(fused_moe.experts_forward, *args, activation=act, tile=TILE, **extra))
            rows.append({"B": b, "routing": routing, "activation": act, "biases": biases,
                         "equal": bool(torch.equal(plain, fast)),
                         "max_abs_diff": float((plain.float() - fast.float()).abs().max())})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 1024, 1536, 2048])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["64,128,8", "128,128,4", "64,256,4", "64,128,4"],
        help="Gluon tiles timed: BN_UP,BN_DOWN,STAGES (the first is the shipped one)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_json(resolve_model(f"dummy:{args.model}").path)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    gen, w_up, w_down, _ = layer_weights(cfg)
    shipped = (moe_gluon.BN_UP, moe_gluon.BN_DOWN, moe_gluon.STAGES)
    checks, timed = [], []
    for b in args.batches:
        checks += check(cfg, gen, w_up, w_down, b)
        print(checks[-6:], flush=True)
        x = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.rand(b, e, device="cuda", generator=gen)
        weights, ids = fused_moe.route(logits, k, "softmax_topk", True)
        row: dict = {"B": b, "tokens_an_expert": b * k / e}
        run = lambda: fused_moe.experts_forward(x, w_up, w_down, weights, ids, tile=TILE)  # noqa: B023, E731
        for name, variant in (("triton", None), *((f"gluon_{v}", v) for v in args.variants)):
            moe_gluon.ENABLED = variant is not None
            if variant:
                moe_gluon.BN_UP, moe_gluon.BN_DOWN, moe_gluon.STAGES = map(int, variant.split(","))
            out = run()
            replay = graphed(run)
            row[f"{name}_us"] = 1e3 * bench_ms(replay, 200)
            row[f"{name}_kernels_us"] = _kernel_us(replay)
            row[f"{name}_equal"] = bool(torch.equal(out, row.setdefault("_want", out)))
        del row["_want"]
        moe_gluon.ENABLED = True
        moe_gluon.BN_UP, moe_gluon.BN_DOWN, moe_gluon.STAGES = shipped
        row["gluon_us"] = row[f"gluon_{args.variants[0]}_us"]
        row["speedup"] = row["triton_us"] / row["gluon_us"]
        timed.append(row)
        print(row, flush=True)
    payload = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"), "model": args.model, "tile": list(TILE),
        "gluon": {"BN_UP": moe_gluon.BN_UP, "BN_DOWN": moe_gluon.BN_DOWN, "BK": moe_gluon.BK,
                  "STAGES": moe_gluon.STAGES},
        "checks": checks, "timed": timed,
    }  # fmt: skip
    if args.json:
        write_json(Path(args.json), payload)
    print(f"all equal: {all(c['equal'] for c in checks)} ({len(checks)} checks)")
    print("| B | tokens an expert | Triton us | " + " | ".join(f"Gluon {v} us" for v in args.variants) + " |")
    for r in timed:
        cells = " | ".join(f"{r[f'gluon_{v}_us']:.1f}{'' if r[f'gluon_{v}_equal'] else ' (differs)'}"
                           for v in args.variants)  # fmt: skip
        print(f"| {r['B']} | {r['tokens_an_expert']:.0f} | {r['triton_us']:.1f} | {cells} |")
    for r in timed:
        print(r["B"], {n: v for n, v in r.items() if n.endswith("kernels_us")})


if __name__ == "__main__":
    main()
