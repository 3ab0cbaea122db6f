"""Does SiLU-and-mul in a cuBLAS-class GEMM's epilogue take the SiLU kernel's energy off a decode step?

At the board's power cap, where the 70B's TP=2 steps run, a call's time is its energy, and the SiLU
kernel after the gate-up product costs 3.5-4.3 mJ a call at the 70B's shard (``gate_up_gemm.py
--sustained``). Triton's fused gate-up spends more than that on its product. This probe builds the
product with CUTLASS 3.x's Hopper GEMM (``cutlass_swiglu.cu``: TMA, warp-specialised cooperative kernel,
2 x 1 clusters; nvcc here, launched through ctypes on torch's stream) alone and with the activation in
its epilogue (the weight's gate and up rows re-laid so each tile holds matching columns), checks the
fused output against the engine's unfused path (``F.linear`` then ``silu_and_mul``: bit for bit) and
times every form at 256 rows as a burst (graphed over L2-cold weight copies) and back to back at the
cap (mJ a call above the spin kernel's power), two rounds in turn.

    pip install --no-deps nvidia-cutlass   # CUTLASS's headers (4.2.0 measured)
    PYTHONPATH=. python -m benchmarks.probes.cutlass_swiglu [--shapes 70b_tp2 8b_tp1] [--json F]

Needs nvcc (sm_90a) and a Hopper GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.output import write_or_print
from benchmarks.harness.timing import cold_weights, graph_ms
from prefixserve.model.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

SOURCE = Path(__file__).with_name("cutlass_swiglu.cu")
SHAPES = {"70b_tp2": (14336, 8192), "8b_tp1": (14336, 4096), "8b_tp2": (7168, 4096)}  # (I, hidden)
# name -> (TILE_N, STREAM_K, EPI) as cutlass_swiglu.cu reads them
VARIANTS = {
    "cutlass product 128x256": (256, 0, 0),
    "cutlass product 128x128 stream-K": (128, 1, 0),
    "cutlass 128x256 + SiLU epilogue": (256, 0, 1),
    "cutlass 128x256 + SiLU epilogue, staged stores": (256, 0, 2),
}
ROWS = 256


def headers() -> Path:
    try:
        import cutlass_library
    except ImportError as exc:
        raise SystemExit("needs CUTLASS's headers: pip install --no-deps nvidia-cutlass") from exc
    return Path(cutlass_library.__file__).parent / "source"


def build(name: str, build_dir: Path) -> Path:
    """One variant as a shared library (CUDA runtime linked in statically)."""
    tile_n, stream_k, epi = VARIANTS[name]
    lib = build_dir / f"cutlass_swiglu_{tile_n}_{stream_k}_{epi}.so"
    root = headers()
    cmd = ["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DNDEBUG"]
    cmd += [
        f"-I{root / 'include'}",
        f"-I{root / 'tools' / 'util' / 'include'}",
        "-shared",
        "-Xcompiler",
        "-fPIC",
    ]
    cmd += ["-cudart", "static", f"-DTILE_N={tile_n}", f"-DSTREAM_K={stream_k}", f"-DEPI={epi}"]
    subprocess.run([*cmd, "-o", str(lib), str(SOURCE)], check=True)
    return lib


class Variant:
    """A built variant's launches over a list of weight copies."""

    def __init__(self, name: str, lib: Path, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
        self.name, self.x = name, x
        tile_n, _, self.epi = VARIANTS[name]
        self.lib = ctypes.CDLL(str(lib))
        self.lib.workspace_bytes.restype = ctypes.c_size_t
        n, k = weights[0].shape
        self.weights = [relaid(w, tile_n // 2) for w in weights] if self.epi else weights
        cols = n // 2 if self.epi else n
        self.out = torch.empty(x.shape[0], cols, device=x.device, dtype=x.dtype)
        self.bad = torch.zeros(1, dtype=torch.int32, device=x.device)
        space = self.lib.workspace_bytes(x.shape[0], n, k)
        self.workspace = torch.zeros(max(space, 16), dtype=torch.uint8, device=x.device)

    def __call__(self, i: int) -> torch.Tensor:
        w = self.weights[i]
        ptr = ctypes.c_void_p
        rc = self.lib.run(
            self.x.shape[0], w.shape[0], w.shape[1], ptr(self.x.data_ptr()), ptr(w.data_ptr()),
            ptr(self.out.data_ptr()), ptr(self.bad.data_ptr()), ptr(self.workspace.data_ptr()),
            ptr(torch.cuda.current_stream().cuda_stream),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"{self.name}: CUTLASS returned {rc}")
        return self.out


def relaid(weight: torch.Tensor, half: int) -> torch.Tensor:
    """[gate; up] as blocks of ``half`` rows: gate block 0, up block 0, gate block 1, ..."""
    n, k = weight.shape
    return weight.view(2, n // 2 // half, half, k).transpose(0, 1).reshape(n, k).contiguous()


def measure(shape: str, libs: dict[str, Path], sampler, floor_w: float, seconds: float) -> dict:
    from benchmarks import power

    inter, hidden = SHAPES[shape]
    ws = cold_weights(2 * inter, hidden, 1 / 32)
    x = torch.randn(ROWS, hidden, device="cuda", dtype=torch.bfloat16)
    product = F.linear(x, ws[0])
    unfused = silu_and_mul(product)
    ref = silu_and_mul_ref(F.linear(x.float(), ws[0].float()))
    forms = {
        "cuBLAS + SiLU kernel": lambda i: silu_and_mul(F.linear(x, ws[i])),
        "cuBLAS product alone": lambda i: F.linear(x, ws[i]),
    }
    checks = {}
    for name, lib in libs.items():
        variant = Variant(name, lib, x, ws)
        got = variant(0).clone()
        want = unfused if variant.epi else product
        # max_err_vs_fp32: the fused forms against the fp32 reference; a plain product against cuBLAS's
        target = ref if variant.epi else want.float()
        checks[name] = {
            "layout_mismatch": int(variant.bad.item()),
            "equal_to_engine": float((got == want).float().mean()),
            "max_err_vs_fp32": float((got.float() - target).abs().max()) / float(target.abs().max()),
        }
        forms[name] = variant
    burst = {name: graph_ms(fn, len(ws)) * 1e3 for name, fn in forms.items()}
    runs = power.forms_in_turn(forms, len(ws), sampler, seconds, floor_w)
    return {"checks": checks, "forms": {n: {"burst_us": burst[n], "back_to_back": runs[n]} for n in forms}}


def report(result: dict) -> str:
    from benchmarks import power

    lines = [
        f"{result['device']}, torch {result['torch']}, commit {result.get('commit')}, {result['date']}: "
        f"spin floor {result['floor_w']:.0f} W, {ROWS} rows, back to back {result['seconds']} s a round",
        "",
        "| shape | form | equal to the engine's output | burst us | back to back us (2 rounds) "
        "| board W | mJ a call above the floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, r in result["shapes"].items():
        for name, f in r["forms"].items():
            check = r["checks"].get(name)
            eq = "-" if check is None else f"{check['equal_to_engine']:.4f}"
            cells = power.rounds_cells(f["back_to_back"])
            lines.append(f"| {shape} | {name} | {eq} | {f['burst_us']:.1f} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["70b_tp2", "8b_tp1"])
    ap.add_argument("--seconds", type=float, default=1.2, help="back to back, each form and round")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from benchmarks import power
    from benchmarks.harness.info import run_info

    torch.zeros(1, device="cuda")
    with tempfile.TemporaryDirectory() as build_dir:
        with concurrent.futures.ThreadPoolExecutor() as pool:
            built = dict(zip(VARIANTS, pool.map(lambda n: build(n, Path(build_dir)), VARIANTS), strict=True))
        sampler = power.Sampler(gpu=str(torch.cuda.current_device()))
        floor_w = power.spin_floor_w(sampler)
        result = run_info(("nvidia-cutlass",)) | {"floor_w": floor_w, "seconds": args.seconds, "shapes": {}}
        for shape in args.shapes:
            result["shapes"][shape] = measure(shape, built, sampler, floor_w, args.seconds)
            torch.cuda.empty_cache()
        sampler.close()
    write_or_print(args.json, result, report(result) + "\n")


if __name__ == "__main__":
    main()
