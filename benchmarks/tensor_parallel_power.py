"""The boards' side of ``benchmarks/tensor_parallel.py --power``: one nvidia-smi sampler per GPU over
each timed decode, the first GPU's sustained ceilings (``benchmarks.power``'s energy model), and the
result file's tables of power, clocks and the model's step at the cap."""

from __future__ import annotations

import os
import time

import torch

from benchmarks.harness.models import model_config
from benchmarks.harness.output import cell, ratio_cell
from benchmarks.harness.step_work import capped_step_ms, decode_step_work


class Boards:
    """One nvidia-smi sampler per visible GPU, for the boards' state over a timed decode."""

    def __init__(self) -> None:
        from benchmarks.power import Sampler

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        self.samplers = [Sampler(gpu=i.strip()) for i in ids]
        self.offset = time.time() - time.monotonic()  # the engine's clock to the samplers'

    def during(self, first: float, last: float) -> list[dict]:
        """Each board's median power and SM clock, lowest clock and throttle reasons, first token to
        last finish (``time.monotonic``)."""
        return [s.window(first + self.offset, last + self.offset) for s in self.samplers]

    def close(self) -> None:
        for sampler in self.samplers:
            sampler.close()


def start_boards(payload: dict, grid: bool) -> Boards:
    """The samplers; for a ``grid`` run first the first GPU's sustained ceilings (copy, read, GEMM,
    spin kernel), whose energy model (``benchmarks.power``) goes into ``payload["power"]``: the grid's
    table reads it, so a compare-only run leaves the grid's model as it was."""
    from benchmarks.power import ceilings

    boards = Boards()
    if grid:
        ceil = ceilings(boards.samplers[0], window_s=1.0)
        payload["power"] = {"commit": payload["commit"], "device": payload["device"], "ceilings": ceil}
        print({k: ceil[k] for k in ("model", "gemm", "read")}, flush=True)
    return boards


def grid_power_lines(payload: dict) -> list[str]:
    """The grid's cells measured with ``--power``: the boards' state over each timed decode, and the
    step time the energy model gives at the cap for the step's counted work."""
    modes = {"auto": "on", "sharing_off": "off", "ceiling": "ceiling"}
    rows = [(r, m) for r in payload["grid"] for m in modes if r.get(f"{m}_boards")]
    if not rows or not payload.get("power"):
        return []
    model = payload["power"]["ceilings"]["model"]
    cfg = model_config(payload["model"])
    own = payload["own"] + payload["gen"] / 2  # a sequence's own tokens, averaged over its decode
    md = [
        "",
        f"## Power during the grid's decodes ({payload['power']['device']})",
        "",
        "Each rank's board over each timed decode (nvidia-smi every 20 ms: medians; `min` the lowest "
        "SM clock seen), and the step time the linear energy model of `benchmarks/power.py` gives at "
        "the board's cap for the step's counted work (`benchmarks/harness/step_work.py`, one rank: the "
        "FLOPs, and the bytes no implementation skips: each weight once, the prefix's KV once, each "
        "sequence's own KV once). Model from this run's sustained ceilings on the first GPU "
        f"(commit {payload['power']['commit']}): {model['j_per_byte_read'] * 1e12:.0f} pJ a byte read, "
        f"{model['j_per_flop'] * 1e12:.2f} pJ a bf16 FLOP, above the spin kernel's {model['floor_w']:.0f} W, "
        f"cap {model['cap_w']:.0f} W. The model is a lead, not a wall (a FLOP at a lower clock costs less).",
        "",
        "| B | P | mode | step ms | W by rank | SM MHz by rank (min) | throttle | TFLOP | GB "
        "| model ms at the cap | step / model |",
        "| ---: | ---: | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r, m in rows:
        tok_s = r.get(f"{m}_tok_s")
        step = r["B"] / tok_s * 1e3 if tok_s else None
        cells = [str(r["B"]), str(r["P"]), modes[m], cell(step, ".1f"), *board_cells(r[f"{m}_boards"])]
        if m == "sharing_off":  # its KV reads depend on what L2 serves, so no count
            cells += ["-"] * 4
        else:
            work = decode_step_work(cfg, payload["tensor_parallel_size"], r["B"], r["P"], own, m == "auto")
            capped = capped_step_ms(work, model)
            cells += [f"{work['flops'] / 1e12:.1f}", f"{work['bytes'] / 1e9:.1f}", f"{capped:.1f}"]
            cells.append(ratio_cell(step, capped, "x"))
        md.append("| " + " | ".join(cells) + " |")
    for r in payload["grid"]:
        off = r.get("sharing_off_tok_s")
        if off and r.get("auto_boards"):
            md += [
                "",
                f"B={r['B']}, P={r['P']}: 3x on/off needs the sharing-on step at "
                f"{r['B'] / off * 1e3 / 3:.1f} ms or less.",
            ]
    return md


def compare_power_lines(payload: dict, runs: list[tuple[str, str]]) -> list[str]:
    """The compare's runs measured with ``--power``: each board's state over the run's decode."""
    rows = [(r, k, label) for r in payload["compare"] for k, label in runs if r.get(f"{k}_boards")]
    if not rows:
        return []
    md = [
        "",
        "Boards over each timed decode (nvidia-smi every 20 ms: medians; `min` the lowest SM clock "
        "seen; every visible GPU, the first being rank 0's; a TP=1 run leaves the second idle):",
        "",
        "| B | run | W by GPU | SM MHz by GPU (min) | throttle |",
        "| ---: | --- | --- | --- | --- |",
    ]
    for r, k, label in rows:
        md.append("| " + " | ".join([str(r["B"]), label, *board_cells(r[f"{k}_boards"])]) + " |")
    return md


def board_cells(boards: list[dict]) -> list[str]:
    """Table cells of the boards' state over a run: power by board, SM clock (lowest), throttle reasons."""
    reasons = sorted({x for b in boards for x in b["reasons"]})
    return [
        " / ".join(cell(b["power_w"]) for b in boards),
        " / ".join(f"{cell(b['sm_mhz'])} ({cell(b['sm_mhz_min'])})" for b in boards),
        ", ".join(reasons) or "-",
    ]
