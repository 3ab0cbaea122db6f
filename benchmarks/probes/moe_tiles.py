"""Probe: the fused MoE kernels' tiles at one model's MoE layer (default Qwen3-30B-A3B), per B: each
candidate (BM, up BN, down BN, BK, warps, stages) checked against the default's output, then timed
graphed; prints the fastest few per B beside the default and ``torch._grouped_mm``, JSON to --json.

    PYTHONPATH=. python -m benchmarks.probes.moe_tiles [--model qwen3-30b-a3b] \
        [--batches 1 64 256 1024] [--narrow | --direct]

``--swap``: the candidates run the products transposed (``fused_moe.Tile.swap``), over 16- to
64-row blocks; the default tile is timed both ways.

``--persistent``: each candidate twice, a program a tile and ``Tile.persistent`` (programs walking
the used blocks' tiles).

``--direct``: a direct step's tiles (T k <= ``fused_moe.DIRECT_MAX``) over four copies of the layer's
weights, each routed apart (L2 holds none of a copy's experts when it comes round, as in a model's
step). At e743384 its candidates included programs owning 48 or 96 columns of a wider tile (grids
sized to the SMs): no faster (docs/kernels.md §4), and the kernels went back to powers of two.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch

from benchmarks.harness.timing import bench_ms, graphed
from benchmarks.moe import grouped_mm_moe, layer_weights
from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels import fused_moe
from prefixserve.model.loader import resolve_model


def candidates(block_m: int, narrow: bool = False) -> list[tuple[int, ...]]:
    """Tiles around ``block_m``; ``narrow`` adds 16- and 32-column tiles and deeper pipelines (a
    decode step's few blocks: more, smaller programs to fill the SMs)."""
    out = []
    bn_ups, bn_downs, stage_counts = (32, 64, 128), (64, 128), (3, 4)
    if narrow:
        bn_ups, bn_downs, stage_counts = (16, 32, 64), (16, 32, 64), (3, 4, 6)
    bms = {block_m} if narrow else {block_m, max(16, block_m // 2), min(128, block_m * 2)}
    for bm in sorted(bms):
        for bn_up, bn_down, bk, warps, stages in itertools.product(
            bn_ups, bn_downs, (64, 128), (4, 8), stage_counts
        ):
            if bm * bn_up > 64 * 128 and warps == 4:
                continue
            if bm <= 32 and warps == 8:
                continue
            out.append((bm, bn_up, bn_down, bk, warps, stages))
    return out


def swap_candidates(default: fused_moe.Tile) -> list[fused_moe.Tile]:
    """The default transposed, then transposed tiles of 16-64 rows by columns, K step and stages."""
    grid = itertools.product((16, 32, 64), (64, 128), (64, 128), (64, 128), (3, 4))
    return [default._replace(swap=True)] + [
        fused_moe.Tile(bm, u, d, k, 4, st, True) for bm, u, d, k, st in grid
    ]


def sweep(
    b: int, tiles: list[tuple[int, ...]], default: tuple[int, ...], run: Callable, time_ms: Callable
) -> list[dict]:
    """Each tile's output against the default's (``run(tile)``: the layer's output; ``time_ms(tile)``),
    fastest first; a tile too large for shared memory is printed and left out."""
    want = run(None)
    timed = []
    for tile in [default, *tiles]:
        try:
            err = float((run(tile).float() - want.float()).abs().max())
            ms = time_ms(tile)
        except Exception as exc:  # a tile too large for shared memory
            print(b, tile, repr(exc)[:100])
            continue
        timed.append({"B": b, "tile": tile, "ms": ms, "err": err, "default": tile == default})
    return sorted(timed, key=lambda r: r["ms"])


def show(title: str, timed: list[dict], top: int) -> None:
    """The default's time beside the fastest ``top`` tiles, in us."""
    dflt = next(r for r in timed if r["default"])
    print(f"{title}: default {dflt['tile']} {dflt['ms'] * 1e3:.1f} us")
    for r in timed[:top]:
        print(f"   {r['tile']} {r['ms'] * 1e3:.1f} us err {r['err']:.3g}")


def direct_candidates() -> list[tuple[int, ...]]:
    """A direct step's tiles: up / down columns a program by stages."""
    spans_up, spans_down = (16, 32, 64, 128), (16, 32, 64, 128)
    return [(16, u, d, 128, 4, st) for u, d, st in itertools.product(spans_up, spans_down, (3, 4, 5))]


def direct_sweep(cfg, batches: list[int], copies: int = 4) -> list[dict]:
    """Each direct tile checked against the default's output, then timed over ``copies`` copies of
    the weights (``graph_ms``), each copy's tokens routed to their own experts."""
    from benchmarks.harness.timing import graph_ms

    e, k, hidden = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    layers = [layer_weights(cfg) for _ in range(copies)]
    gen = layers[0][0]
    results = []
    for b in batches:
        if b * k > fused_moe.DIRECT_MAX:
            continue
        x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        routes = [fused_moe.route(torch.randn(b, e, device="cuda", generator=gen), k, "softmax_topk", True)
                  for _ in range(copies)]  # fmt: skip

        def run(i: int, tile: tuple[int, ...] | None) -> torch.Tensor:
            _, w_up, w_down, _ = layers[i]
            return fused_moe.experts_forward(x, w_up, w_down, *routes[i], tile=tile)  # noqa: B023

        timed = sweep(
            b, direct_candidates(), fused_moe.tiles(b, k, e), lambda t: run(0, t),
            lambda t: graph_ms(lambda i: run(i, t), copies, reps=50),
        )  # fmt: skip
        show(f"B={b} direct, a layer", timed, 8)
        results.append({"B": b, "copies": copies, "timed": timed})
    return results


def grid_sweep(cfg, args: argparse.Namespace) -> list[dict]:
    """Each B's candidate tiles on one layer's weights, graphed, beside ``torch._grouped_mm``."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    gen, w_up, w_down, router = layer_weights(cfg)
    results = []
    for b in args.batches:
        x = torch.randn(b, cfg.hidden_size, device=w_up.device, dtype=w_up.dtype, generator=gen)
        weights, ids = fused_moe.route(x @ router.T, k, cfg.router_rule, cfg.norm_topk_prob)
        args_b = (x, w_up, w_down, weights, ids)
        base = bench_ms(graphed(lambda: grouped_mm_moe(*args_b)), 100)  # noqa: B023
        default = fused_moe.tiles(b, k, e)
        cands = swap_candidates(default) if args.swap else candidates(default.bm, args.narrow)
        if args.persistent:  # each candidate both ways: a program a tile, and programs walking the tiles
            plain = [fused_moe.Tile(*c)._replace(persistent=False) for c in cands]
            cands = [t for c in plain for t in (c, c._replace(persistent=True))]

        def run(tile: tuple[int, ...] | None) -> torch.Tensor:
            return fused_moe.experts_forward(*args_b, tile=tile)  # noqa: B023

        timed = sweep(
            b, cands[:: max(1, len(cands) // args.limit)], default, run,
            lambda t: bench_ms(graphed(lambda: run(t)), 100),
        )  # fmt: skip
        show(f"B={b}: grouped_mm {base * 1e3:.1f} us", timed, 5)
        results.append({"B": b, "grouped_mm_ms": base, "timed": timed})
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--limit", type=int, default=40, help="candidates per B, spread over the list")
    ap.add_argument("--narrow", action="store_true", help="16- and 32-column tiles, deeper pipelines")
    ap.add_argument("--direct", action="store_true", help="a direct step's tiles over weight copies")
    ap.add_argument("--swap", action="store_true", help="transposed products (Tile.swap)")
    ap.add_argument("--persistent", action="store_true", help="each tile also as persistent programs")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = ModelConfig.from_json(resolve_model(f"dummy:{args.model}").path)
    results = direct_sweep(cfg, args.batches) if args.direct else grid_sweep(cfg, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
