"""Probe: the MoE grouping (``moe_grouping.align``: assignments by expert into blocks) alone, graphed
as a step runs it (48 layers back to back, each its own routing), per B; the shipped chunks and warps
against other settings, and against another tree's grouping (``--baseline``: a file with an
``align``, such as an older ``moe_grouping.py``) in the same run, each checked to give the same tables.

    PYTHONPATH=. python -m benchmarks.probes.moe_grouping [--baseline OLD/moe_grouping.py] [--json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import time
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.harness.info import git_commit
from benchmarks.harness.output import write_json
from benchmarks.harness.timing import graph_ms
from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels import fused_moe, moe_grouping
from prefixserve.model.loader import resolve_model

LAYERS = 48  # routings a graph: a step's MoE layers


def _module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_grouping", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time(mod: ModuleType, routings: list[torch.Tensor], experts: int, block_m: int) -> float:
    """Microseconds a grouping, each of ``routings`` grouped once a replay."""
    return 1e3 * graph_ms(lambda i: mod.align(routings[i], experts, block_m), len(routings))


def _same(one: ModuleType, other: ModuleType, ids: torch.Tensor, experts: int, block_m: int) -> bool:
    """Whether two groupings give the same tables (rows past a block's real ones are never read)."""
    a, b = one.align(ids, experts, block_m), other.align(ids, experts, block_m)
    if not (torch.equal(a.block_expert, b.block_expert) and torch.equal(a.block_rows, b.block_rows)):
        return False
    real = torch.arange(block_m, device=ids.device)[None, :] < a.block_rows[:, None]
    mine, theirs = a.slots.view_as(real)[real], b.slots.view_as(real)[real]
    return torch.equal(a.used, b.used) and torch.equal(mine, theirs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16, 32, 64, 256, 1024, 2048, 8192])
    ap.add_argument("--baseline", default=None, help="another tree's file with an align, timed beside")
    ap.add_argument("--chunks", type=int, nargs="+", default=[128], help="GROUP_CHUNK values")
    ap.add_argument(
        "--expert-programs-max",
        type=int,
        nargs="+",
        default=[1024],
        help="EXPERT_PROGRAMS_MAX values (powers of 2)",
    )
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_json(resolve_model(f"dummy:{args.model}").path)
    experts, k = cfg.num_experts, cfg.num_experts_per_tok
    baseline = _module(args.baseline) if args.baseline else None
    shipped = (moe_grouping.GROUP_CHUNK, moe_grouping.EXPERT_PROGRAMS_MAX, moe_grouping.GROUP_WARPS)
    rows = []
    for b in args.batches:
        block_m = fused_moe.tiles(b, k, experts).bm
        draws = [torch.rand(b, experts, device="cuda") for _ in range(LAYERS)]
        routings = [d.topk(k).indices.to(torch.int32).view(-1) for d in draws]
        row: dict = {"B": b, "assignments": b * k, "block_m": block_m}
        if baseline is not None:
            row["baseline_us"] = _time(baseline, routings, experts, block_m)
            row["baseline_same_tables"] = _same(baseline, moe_grouping, routings[0], experts, block_m)
        for setting in itertools.product(args.chunks, args.expert_programs_max, args.warps):
            moe_grouping.GROUP_CHUNK, moe_grouping.EXPERT_PROGRAMS_MAX, moe_grouping.GROUP_WARPS = setting
            row["chunk{}_experts{}_w{}_us".format(*setting)] = _time(moe_grouping, routings, experts, block_m)
        moe_grouping.GROUP_CHUNK, moe_grouping.EXPERT_PROGRAMS_MAX, moe_grouping.GROUP_WARPS = shipped
        row["shipped_us"] = _time(moe_grouping, routings, experts, block_m)
        rows.append(row)
        print(row, flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "layers_a_graph": LAYERS,
        "baseline": args.baseline,
        "rows": rows,
    }
    if args.json:
        write_json(Path(args.json), result)
    keys = [key for key in rows[0] if key.endswith("_us")]
    if baseline is not None:
        print("same tables as the baseline:", all(row["baseline_same_tables"] for row in rows))
    print("B      " + " ".join(f"{key[:-3]:>14s}" for key in keys))
    for row in rows:
        print(f"{row['B']:<6d} " + " ".join(f"{row[key]:14.2f}" for key in keys))


if __name__ == "__main__":
    main()
