"""What TMA multicast takes off a shared read: the last lever named for the 70B's sharing-on step.

The shared attention kernel's row tiles of one KV head each read the segment's K and V tiles: the
first read comes from HBM, the later ones from L2, and at the board's power cap their energy is the
step's time (docs/kernels.md §8). A cluster of CTAs can share one read: one CTA's bulk copy multicast
into every CTA's shared memory. Triton 3.6 cannot express that, so this probe times a CUDA kernel
(`multicast_read.cu`, compiled here by nvcc, launched through the driver with ctypes): groups of G CTAs
read the same slice in step, a 2 GB buffer so the first read of each line comes from HBM, each CTA
its own copy or, in clusters of 2 or 4, one copy multicast. Energy a delivered byte is the board's
power above the spin kernel's floor over the delivery rate (``benchmarks.power``); a group's later
reads cost (G x that - the alone row's) / (G - 1) a byte. Every mode's output is checked against numpy.

    PYTHONPATH=. python -m benchmarks.probes.multicast_energy [--groups 4 8 16] [--json F]

Needs nvcc (sm_90a) and a Hopper GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness.output import write_or_print

SOURCE = Path(__file__).with_name("multicast_read.cu")
CHUNK, STAGES, CONSUMERS, GRID = 16384, 4, 128, 128  # as multicast_read.cu; GRID CTAs a launch
SMEM = STAGES * CHUNK + 2 * STAGES * 8  # the ring and its full / empty barriers
_MAX_DYNAMIC_SMEM = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class GroupRead:
    """The kernel built for one cluster size, and launches of it on the current stream."""

    def __init__(self, cluster: int, build_dir: Path) -> None:
        cubin = build_dir / f"multicast_read_{cluster}.cubin"
        cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-O3", f"-DCLUSTER={cluster}", "-o", str(cubin), str(SOURCE)]
        subprocess.run(cmd, check=True)
        torch.zeros(1, device="cuda")  # the primary context current on this thread
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), cubin.read_bytes()))
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), self.module, b"group_read"))
        self._check(self.cuda.cuFuncSetAttribute(self.fn, _MAX_DYNAMIC_SMEM, SMEM))
        self.cluster = cluster

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"CUDA driver call failed: {rc}")

    def launch(
        self, x: torch.Tensor, out: torch.Tensor, slice_bytes: int, reps: int, group: int, multicast: bool
    ):
        """A launch with no arguments: GRID CTAs, ``group`` of them reading each slice ``reps`` times."""
        if multicast and group % self.cluster:
            raise ValueError(f"group {group} must be a multiple of the cluster ({self.cluster}) to multicast")
        values = [
            ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_longlong(slice_bytes),
            ctypes.c_int(reps),
            ctypes.c_int(group),
            ctypes.c_int(int(multicast)),
        ]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )

        def run() -> None:
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self._check(
                self.cuda.cuLaunchKernel(
                    self.fn, GRID, 1, 1, CONSUMERS + 32, 1, 1, SMEM, stream, params, None
                )
            )

        run.keep = (values, params)  # the argument buffers live as long as the launch
        return run


def expected(x: torch.Tensor, slice_bytes: int, reps: int, group: int) -> np.ndarray:
    """Each CTA's consumer threads' xor over their words of every chunk of the slice, ``reps`` times."""
    words = x.cpu().numpy().view(np.uint32)
    per = slice_bytes // 4
    out = np.zeros((GRID, CONSUMERS), np.uint32)
    for cta in range(GRID):
        s = cta // group
        chunks = words[s * per : (s + 1) * per].reshape(-1, CHUNK // 16 // CONSUMERS, CONSUMERS, 4)
        out[cta] = np.bitwise_xor.reduce(chunks, axis=(0, 1, 3)) if reps % 2 else 0
    return out


def wrong_outputs(kernels: dict[int, GroupRead]) -> dict[str, int]:
    """Every mode on a small buffer, against numpy: how many threads' results differ."""
    wrong = {}
    for cluster, kernel in kernels.items():
        for group, multicast in ((1, False), (cluster, False), (cluster, True), (2 * cluster, True)):
            for reps in (1, 3):
                slice_bytes = 8 * CHUNK
                x = torch.randint(
                    -(2**31), 2**31 - 1, (GRID * slice_bytes // 4,), dtype=torch.int32, device="cuda"
                )
                out = torch.zeros(GRID * CONSUMERS, dtype=torch.int32, device="cuda")
                kernel.launch(x, out, slice_bytes, reps, group, multicast)()
                got = out.cpu().numpy().view(np.uint32).reshape(GRID, CONSUMERS)
                key = f"cluster {cluster}, group {group}, multicast {int(multicast)}, reps {reps}"
                wrong[key] = int((got != expected(x, slice_bytes, reps, group)).sum())
    return wrong


def measure(
    kernels: dict[int, GroupRead], groups: list[int], footprint_mb: int, seconds: float
) -> list[dict]:
    """Each group size's own copies and multicast in each cluster size, back to back, with the board."""
    from benchmarks import power

    sampler = power.Sampler(gpu=str(torch.cuda.current_device()))
    floor_w = power.spin_floor_w(sampler, 2.0)
    foot = footprint_mb << 20
    x = torch.randint(-(2**31), 2**31 - 1, (foot // 4,), dtype=torch.int32, device="cuda")
    out = torch.zeros(GRID * CONSUMERS, dtype=torch.int32, device="cuda")
    modes = [(1, 0)] + [(g, c) for g in groups if g > 1 for c in [0, *kernels] if not c or g % c == 0]
    rows = []
    for group, cluster in modes:
        slice_bytes = foot // (GRID // group)
        reps = max(1, (2 << 30) // (GRID * slice_bytes))  # about 2 GB delivered a launch
        kernel = kernels[cluster or min(kernels)]
        run = kernel.launch(x, out, slice_bytes, reps, group, multicast=bool(cluster))
        run()
        torch.cuda.synchronize()
        st = power.sustained(run, sampler, seconds)
        rate = GRID * slice_bytes * reps / (st["ms"] * 1e-3) / 1e12
        row = {"group": group, "multicast_cluster": cluster, "ms": st["ms"], "W": st["power_w"]}
        row |= {
            "sm_mhz": st["sm_mhz"],
            "delivered_TBps": rate,
            "pJ_per_delivered_byte": (st["power_w"] - floor_w) / rate,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    sampler.close()
    alone = rows[0]["pJ_per_delivered_byte"]
    for r in rows[1:]:  # each later read of a line, the first one's cost (alone) taken off
        r["pJ_per_later_byte"] = (r["group"] * r["pJ_per_delivered_byte"] - alone) / (r["group"] - 1)
    return [{"floor_w": floor_w, "footprint_MB": footprint_mb}, *rows]


def report(result: dict) -> str:
    head, *rows = result["rows"]
    lines = [
        f"{result['device']}, torch {result['torch']}, commit {result.get('commit')}: spin floor "
        f"{head['floor_w']:.0f} W, {head['footprint_MB']} MB buffer; "
        f"wrong outputs {sum(result['wrong'].values())}",
        "",
        "| group | copies | ms a launch | delivered TB/s | W | SM MHz | pJ a delivered byte "
        "| pJ a later byte |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        how = f"multicast in {r['multicast_cluster']}s" if r["multicast_cluster"] else "own"
        later = f"{r['pJ_per_later_byte']:.1f}" if "pJ_per_later_byte" in r else "-"
        lines.append(
            f"| {r['group']} | {how} | {r['ms']:.3f} | {r['delivered_TBps']:.2f} | {r['W']:.0f} "
            f"| {r['sm_mhz']} | {r['pJ_per_delivered_byte']:.1f} | {later} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", nargs="+", type=int, default=[2, 4, 8, 16], help="CTAs reading each slice")
    ap.add_argument("--clusters", nargs="+", type=int, default=[2, 4], help="multicast cluster sizes")
    ap.add_argument("--footprint-mb", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from benchmarks.harness.info import run_info

    with tempfile.TemporaryDirectory() as build:
        kernels = {c: GroupRead(c, Path(build)) for c in args.clusters}
    result = run_info() | {"wrong": wrong_outputs(kernels)}
    result["rows"] = measure(kernels, args.groups, args.footprint_mb, args.seconds)
    write_or_print(args.json, result, report(result) + "\n")


if __name__ == "__main__":
    main()
