"""Do the decode products read their weights faster as split-K partials that the next norm sums?

At 1-64 rows a product's programs are its column tiles: Qwen3-30B-A3B's o projection (2,048 columns)
is 64 programs of 32 on 132 SMs, Llama-3.1-8B's qkv 192 (1.5 waves). Cutting K into S slices
(``skinny_partials``, ``fp8_partials``: program (tile, slice) writes fp32 partials [S, M, N]) gives
S times the programs; an add-RMSNorm sums the planes (``fused.add_rms_norm`` takes [S, T, N]), so
no reduce kernel is added. Each form is timed as a CUDA graph over weight copies that do not fit L2
(``benchmarks.harness.timing``), the product alone and paired with the add-RMSNorm, bf16 and FP8
(W8A8, x's codes given) at the shapes named; the error is the pair's norm output against fp64.

``--engine-ab MODEL ...`` times whole decode steps (``benchmarks.dense.engine_decode``, CUDA graphs,
128-token prompts, 64 generated) with the engine's decode rule (``decode_split.partials``) off and on
(``--switch gate_up``: the FP8 gate-up product's fused SiLU-and-mul instead, ``fp8.gated``;
``--switch moe_route``: a direct MoE step's routing inside the up kernel, ``fused_moe.routed_forward``;
``--switch router_split``: that step's router in K slices, ``decode_split.router_partials``;
``--switch moe_parts``: each MoE layer's expert outputs summed by the next norm, not a combine kernel,
``fused.moe_parts_to_norm``; ``--switch fp8_mid``: FP8 products past 64 rows in K slices on the Triton
kernel, ``fused.fp8_mid_products``; ``--attention none --prompt-len 64``: ``benchmarks/moe.py``'s ceiling),
a fresh engine each, in turn for ``--rounds``; MODEL ``dummy:NAME`` or ``dummy:NAME+fp8``
(``quantization="fp8"``). ``--patch MODULE:NAME=VALUE``: set a module constant (a Python literal) for
the whole run first, such as a tile the product sweep preferred.

PYTHONPATH=. python -m benchmarks.probes.skinny_split [--rows 1 64] [--shapes moe_o 8b_down ...]
    [--splits 2 4 8] [--out FILE] [--engine-ab dummy:llama-3.1-8b+fp8 ... --rounds 2 --batches 1 64]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness import run_info
from benchmarks.harness.timing import cold_weights, graph_ms
from prefixserve.model import fp8, fused
from prefixserve.model.kernels import fp8_matmul, skinny_matmul
from prefixserve.model.kernels.rms_norm import add_rms_norm_ref

EPS = 1e-5
# name: (N, K, FP8 weights)
SHAPES = {
    "moe_qkv": (5120, 2048, False),
    "moe_o": (2048, 4096, False),
    "moe_router": (128, 2048, False),  # its partials would be summed where the logits are read
    "8b_qkv": (6144, 4096, False),
    "8b_o": (4096, 4096, False),
    "8b_down": (4096, 14336, False),
    "8b_qkv_fp8": (6144, 4096, True),
    "8b_o_fp8": (4096, 4096, True),
    "8b_down_fp8": (4096, 14336, True),
    "8b_gate_up_fp8": (28672, 4096, True),  # its next kernel is SiLU-and-mul (timed with the norm here)
}


def _weights(n: int, k: int, fp8_weights: bool, budget: int = 256 << 20) -> list:
    """Copies of a random weight filling ``budget`` bytes (``timing.cold_weights``: each out of L2
    when it comes round again): bf16 tensors, or their (codes, scales) at half the bytes a copy."""
    ws = cold_weights(n, k, 1 / k**0.5, budget=2 * budget if fp8_weights else budget)
    return [fp8.quantize_rows(w) for w in ws] if fp8_weights else ws


def _product(x, x_codes, w, splits: int) -> torch.Tensor:
    if isinstance(w, tuple):
        if splits == 1:
            return fp8_matmul.launch(x, w[0], w[1], x_codes=x_codes)
        return fp8_matmul.fp8_partials(x, w[0], w[1], splits, x_codes=x_codes)
    if splits == 1:
        return skinny_matmul.skinny_linear(x, w)
    return skinny_matmul.skinny_partials(x, w, splits)


def point(name: str, rows: int, splits: list[int]) -> dict:
    n, k, is_fp8 = SHAPES[name]
    ws = _weights(n, k, is_fp8)
    dev = torch.device("cuda")
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    x_codes = fp8_matmul.quantize_rows(x) if is_fp8 else None
    res = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    nw = torch.rand(n, device=dev, dtype=torch.bfloat16) + 0.5
    w0 = ws[0]
    xs = x.double() if x_codes is None else x_codes[0].double() * x_codes[1].double()
    wd = fp8.dequantize(*w0).double() if is_fp8 else w0.double()
    ref = add_rms_norm_ref(xs @ wd.T, nw.double(), EPS, res.double())[0]
    block = fp8_matmul.block_k_for(rows, False) if is_fp8 else skinny_matmul.BLOCK_K
    row: dict = {
        "shape": name,
        "N": n,
        "K": k,
        "fp8": is_fp8,
        "rows": rows,
        "bytes": n * k * (1 if is_fp8 else 2),
    }
    for s in [1, *splits]:
        if k % (s * block):
            continue

        def pair(i: int, s=s):
            return fused.add_rms_norm(_product(x, x_codes, ws[i], s), nw, EPS, res)

        got = pair(0)[0]
        row[f"s{s}_err"] = float((got.double() - ref).abs().max() / ref.abs().max())
        row[f"s{s}_us"] = 1e3 * graph_ms(lambda i, s=s: _product(x, x_codes, ws[i], s), len(ws))
        row[f"s{s}_pair_us"] = 1e3 * graph_ms(pair, len(ws))
    ws.clear()
    torch.cuda.empty_cache()
    return row


SWITCHES = {  # --switch: what --engine-ab turns
    "split_k": fused.split_k_products,
    "gate_up": fused.gate_up_kernels,
    "moe_route": fused.moe_routing_in_experts,
    "router_split": fused.router_split_k,
    "moe_parts": fused.moe_parts_to_norm,
    "fp8_mid": fused.fp8_mid_products,
}


def engine_ab(
    models: list[str],
    batches: list[int],
    rounds: int,
    switch: str = "split_k",
    attention: str = "auto",
    prompt_len: int = 128,
) -> list[dict]:
    """Whole decode steps with ``switch`` off and on (the decode split rule, or the gate-up product's
    fused activation: ``SWITCHES``), a fresh engine each, in turn; ``attention`` "none": the steps
    without attention (``benchmarks/moe.py``'s ceiling)."""
    from benchmarks.dense import _collect, engine_decode
    from prefixserve import LLM

    rows = []
    for spec in models:
        name, _, quant = spec.partition("+")
        for r in range(rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                with SWITCHES[switch](on):
                    llm = LLM(
                        model=name, quantization=quant or None, dtype="bfloat16", device="cuda",
                        max_num_seqs=max(batches), attention=attention, progress=False,
                        max_num_batched_tokens=max(8192, max(batches) * prompt_len),
                    )  # fmt: skip
                    for b in batches:
                        got = engine_decode(llm, b, prompt_len, 64)
                        rows.append({"model": spec, "round": r, "switch": switch, "on": on, "B": b, **got})
                        print(rows[-1], flush=True)
                    llm.shutdown()
                    del llm
                    _collect()
    for spec in models:
        for b in batches:
            mine = [x for x in rows if x["model"] == spec and x["B"] == b]
            off = min(x["ms"] for x in mine if not x["on"])
            on = min(x["ms"] for x in mine if x["on"])
            off_gpu = min(x["gpu_ms"] for x in mine if not x["on"])
            on_gpu = min(x["gpu_ms"] for x in mine if x["on"])
            print(
                f"{spec:>28} B={b:4d}: off {off:.3f} ms (GPU {off_gpu:.3f}), on {on:.3f} ms "
                f"(GPU {on_gpu:.3f}) ({off / on:.3f}x, GPU {off_gpu / on_gpu:.3f}x)",
                flush=True,
            )
    return rows


def patch(spec: str) -> str:
    """Set ``MODULE:NAME=VALUE`` (VALUE a Python literal) and return the spec, for the result file."""
    import ast
    import importlib

    target, _, value = spec.partition("=")
    module, _, name = target.partition(":")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"--patch: {module} has no {name}")
    setattr(mod, name, ast.literal_eval(value))
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 3, 4, 7, 8])
    ap.add_argument("--out", default=None)
    ap.add_argument("--engine-ab", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="split_k", help="what --engine-ab turns")
    ap.add_argument("--attention", default="auto", help="--engine-ab's backend ('none': the ceiling's steps)")
    ap.add_argument("--prompt-len", type=int, default=128, help="--engine-ab's prompt tokens")
    ap.add_argument("--patch", nargs="*", default=[], help="MODULE:NAME=VALUE constants set first")
    args = ap.parse_args()
    patches = [patch(spec) for spec in args.patch]
    from benchmarks.harness.timing import measure_ceilings

    copy_tbps, _ = measure_ceilings(torch.device("cuda"))
    rows = []
    for name in args.shapes:
        for m in args.rows:
            r = point(name, m, args.splits)
            r["bytes_us"] = r["bytes"] / (copy_tbps * 1e6)
            rows.append(r)
            forms = sorted(
                {key.split("_")[0] for key in r if key.startswith("s") and key.endswith("_pair_us")}
            )
            best = min(forms, key=lambda f: r[f"{f}_pair_us"])
            print(
                f"{name:>12} {m:3d} rows (bytes {r['bytes_us']:5.1f} us): "
                + ", ".join(f"{f} {r[f + '_us']:5.1f}/{r[f + '_pair_us']:5.1f}" for f in forms)
                + f"  best {best} {r['s1_pair_us'] / r[best + '_pair_us']:.2f}x (err {r[best + '_err']:.1e})",
                flush=True,
            )
    payload = {**run_info(), "copy_TBps": copy_tbps, "rows": rows, "patches": patches}
    if args.engine_ab:
        payload["engine_ab"] = engine_ab(
            args.engine_ab, args.batches, args.rounds, args.switch, args.attention, args.prompt_len
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
