"""What this machine can move, measured in the same run as the tiers, so a tier's rate reads as a
fraction of the machine's and not of our own earlier numbers.

* ``pinned_h2d_gbs``: one large pinned host tensor copied to the GPU (the PCIe / C2C line rate).
* ``sequential_read_gbs``: the given files read front to back with O_DIRECT (buffered where refused) in
  large reads, one thread, as ``dd iflag=direct`` does: the drive's plain sequential rate.
* ``fio_read_gbs``: the same files read by ``fio`` (libaio, O_DIRECT, queue depth 8), if fio is here.

    python -m benchmarks.io_rates DIR     # the rates for DIR's files (e.g. a module store)
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch


def pinned_h2d_gbs(nbytes: int = 1 << 30, trials: int = 5) -> float | None:
    """GB/s of ``copy_`` from one pinned host tensor to the GPU (median of ``trials``); None without one."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def sequential_read_gbs(paths: list[Path], block: int = 8 << 20) -> tuple[float, bool]:
    """GB/s of reading ``paths`` front to back, one thread, ``block`` bytes a read; and whether
    O_DIRECT was used (it bypasses the page cache, so a file just written is read from the drive)."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    view = memoryview(buf)
    total, direct, t0 = 0, hasattr(os, "O_DIRECT"), time.perf_counter()
    for path in paths:
        fd = -1
        if direct:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct = False
        if fd < 0:
            fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [view], offset):
                offset += n
            total += offset
        finally:
            os.close(fd)
    return total / max(1e-9, time.perf_counter() - t0) / 1e9, direct


def fio_read_gbs(paths: list[Path], block: str = "8M", depth: int = 8) -> float | None:
    """GB/s fio reads ``paths`` at (libaio, O_DIRECT, read-only); None if fio is not installed or fails."""
    fio = shutil.which("fio")
    if fio is None or not paths:
        return None
    cmd = [
        fio, "--name=seqread", "--rw=read", "--readonly", "--direct=1", "--ioengine=libaio",
        f"--iodepth={depth}", f"--bs={block}", "--output-format=json",
        "--filename=" + ":".join(str(p).replace(":", "\\:") for p in paths),
        f"--size={sum(p.stat().st_size for p in paths)}",
    ]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
        return json.loads(out[out.index("{") :])["jobs"][0]["read"]["bw_bytes"] / 1e9
    except (subprocess.SubprocessError, ValueError, KeyError, IndexError):
        return None


def machine_rates(paths: list[Path]) -> dict[str, float | bool | None]:
    """All three, for ``paths`` (the tier's own files)."""
    seq, direct = sequential_read_gbs(paths) if paths else (None, False)
    return {
        "pinned_h2d_gbs": pinned_h2d_gbs(),
        "sequential_read_gbs": seq,
        "sequential_read_direct": direct,
        "fio_read_gbs": fio_read_gbs(paths),
        "files_bytes": sum(p.stat().st_size for p in paths),
    }


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "directory", type=Path, help="the files whose plain read rate to measure (e.g. a module store)"
    )
    args = ap.parse_args(argv)
    files = sorted(p for p in args.directory.iterdir() if p.is_file())
    print(json.dumps(machine_rates(files), indent=1))


if __name__ == "__main__":
    main()
