"""A slim FlashInfer for ``benchmarks/peers_gpu.py``: small enough to travel with the repo to a GPU machine.

The ``flashinfer-python`` wheel (0.7.2: 63 MB zipped, 450 MB unpacked) is mostly sources and headers
for ops the comparison never builds (MoE, GEMM, MLA, sampling, ...). The device machine receives the
working tree plus at most 64 MiB of carried files and has no network, so this keeps:
  * every Python file (``import flashinfer`` imports most subpackages at top level);
  * ``data/include``, ``data/spdlog/include``, CUTLASS's and CCCL's header trees whole (CCCL builds
    some include paths from macros, so they are not pruned by a scan);
  * of ``data/csrc`` (260 MB of kernels): the jinja templates and the files that the JIT specs of batch
    decode, batch prefill (FA2, FA2's two paged-stride variants, FA3: the cascade's levels on Hopper)
    and the cascade merge name, plus every csrc file reached from them by ``#include`` (a scan that
    ignores ``#if``, so it keeps more rather than less).
The JIT specs are generated here on the CPU (``FLASHINFER_CUDA_ARCH_LIST`` set: no GPU needed), and the
scan starts from the sources they generate. Also saved: the ``apache-tvm-ffi`` wheel that FlashInfer's
JIT binds through (absent from the device image), for CPython 3.12 on x86-64.

    python benchmarks/peers_gpu_wheel.py build [--wheel FILE] [--out .fi]   # here, once
    python benchmarks/peers_gpu_wheel.py install [--out .fi] [--target DIR] # there (peers_gpu.py does it)

Benchmark-only: the engine never imports flashinfer.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = Path("/tmp/fi/flashinfer_python-0.7.2-py3-none-any.whl")
OUT = ROOT / ".fi"
TARGET = Path("/tmp/fi_site")
TARBALL = "flashinfer-slim.tar.xz"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
DEVICE_PY = ("--python-version", "3.12", "--implementation", "cp")
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")

# header trees kept whole, relative to flashinfer/data
HEADER_TREES = (
    "include",
    "spdlog/include",
    "cutlass/include",
    "cutlass/tools/util/include",
    "cccl/cub/cub",
    "cccl/libcudacxx/include",
    "cccl/thrust/thrust",
)
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)

# run against the unpacked full package: the JIT specs the comparison uses, generated on the CPU
SPECS = """
import json, sys, torch
from flashinfer.jit.attention import modules as m
from flashinfer.jit import cascade
bf = torch.bfloat16
args = (bf, bf, bf, torch.int32, 128, 128, 0, False, False)
specs = [m.gen_batch_decode_module(*args), cascade.gen_cascade_module()]
for backend in ("fa2", "fa3"):
    specs.append(m.gen_batch_prefill_module(backend, *args, False))
specs.append(m._gen_batch_prefill_primary_module("fa2", *args, False))
specs.append(m._gen_batch_prefill_independent_paged_module("fa2", *args, False))
print("SOURCES " + json.dumps(sorted({str(s) for spec in specs for s in spec.sources})))
"""


def spec_sources(site: Path, workspace: Path) -> list[Path]:
    """The sources of the comparison's JIT modules (generated ones under ``workspace``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
        "FLASHINFER_WORKSPACE_BASE": str(workspace),
    }
    done = subprocess.run([sys.executable, "-c", SPECS], env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SOURCES ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"generating the JIT specs failed:\n{done.stderr[-3000:]}")
    import json

    return [Path(p) for p in json.loads(lines[-1][len("SOURCES ") :])]


def scan_includes(seeds: list[Path], roots: list[Path]) -> set[Path]:
    """Every file under ``roots`` reached from ``seeds`` by ``#include`` (conditions ignored)."""
    seen: set[Path] = set()
    todo = list(seeds)
    while todo:
        path = todo.pop()
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for name in INCLUDE.findall(text):
            for base in (path.parent, *roots):
                cand = (base / name).resolve()
                if cand.is_file():
                    if cand not in seen:
                        seen.add(cand)
                        todo.append(cand)
                    break
    return seen


def keep_list(pkg: Path, sources: list[Path]) -> list[Path]:
    """The files of the unpacked ``pkg`` (its ``flashinfer`` folder) the slim copy keeps."""
    data, csrc = pkg / "data", pkg / "data" / "csrc"
    keep = {p for p in pkg.rglob("*.py") if data not in p.parents or p.parent == data}
    for tree in HEADER_TREES:
        keep |= {p for p in (data / tree).rglob("*") if p.is_file()}
    keep |= set(csrc.glob("*.jinja"))
    names = {s.name for s in sources}
    direct = {p for p in csrc.glob("*") if p.name in names} | {s for s in sources if csrc in s.parents}
    roots = [csrc, data / "include", *(data / t for t in HEADER_TREES)]
    reached = scan_includes([*sources, *direct], roots)
    keep |= direct | {p for p in reached if csrc in p.parents}
    return sorted(p for p in keep if p.is_file())


def build(wheel: Path, out: Path) -> Path:
    """Write ``out/flashinfer-slim.tar.xz`` (+ its file list) and the tvm-ffi wheel; return the tarball."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        pkg = site / "flashinfer"
        sources = spec_sources(site, Path(tmp) / "ws")
        files = keep_list(pkg, sources)
        dist = next(site.glob("flashinfer_python-*.dist-info"))
        tar_path = out / TARBALL
        with tarfile.open(tar_path, "w:xz", preset=6) as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(site)), recursive=False)
            for f in dist.iterdir():  # importlib.metadata.version("flashinfer-python") reads it
                if f.name != "RECORD":
                    tar.add(f, arcname=str(f.relative_to(site)), recursive=False)
        total = sum(f.stat().st_size for f in files)
        listing = [f"{f.relative_to(site)}\t{f.stat().st_size}" for f in files]
        (out / "MANIFEST.txt").write_text("\n".join(listing) + "\n")
    if not list(out.glob("apache_tvm_ffi-*.whl")):
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *DEVICE_PY]
        for plat in DEVICE_PLATFORMS:
            pip += ["--platform", plat]
        subprocess.run([*pip, "-d", str(out), TVM_FFI], check=True)
    size = tar_path.stat().st_size / 2**20
    print(f"{len(files)} files, {total / 2**20:.1f} MiB unpacked; {tar_path}: {size:.1f} MiB")
    return tar_path


def install(out: Path = OUT, target: Path = TARGET) -> Path:
    """Unpack the slim FlashInfer and the tvm-ffi wheel into ``target`` (once) and put it on sys.path."""
    stamp = target / ".complete"
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tarfile.open(out / TARBALL) as tar:
            tar.extractall(target, filter="data")
        tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
        for whl in out.glob("apache_tvm_ffi-*.whl"):
            if tag not in whl.name:  # built for the device's Python; elsewhere the installed one serves
                continue
            with zipfile.ZipFile(whl) as z:
                z.extractall(target)
                for info in z.infolist():  # zipfile drops the execute bits of shared libraries
                    if info.external_attr >> 16 & 0o111:
                        (target / info.filename).chmod(info.external_attr >> 16 & 0o777)
        stamp.touch()
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("build")
    b.add_argument("--wheel", type=Path, default=WHEEL)
    b.add_argument("--out", type=Path, default=OUT)
    i = sub.add_parser("install")
    i.add_argument("--out", type=Path, default=OUT)
    i.add_argument("--target", type=Path, default=TARGET)
    args = ap.parse_args()
    if args.mode == "build":
        build(args.wheel, args.out)
    else:
        print(install(args.out, args.target))


if __name__ == "__main__":
    main()
