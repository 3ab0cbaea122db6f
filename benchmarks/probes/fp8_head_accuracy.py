"""Probe: would an FP8 LM head be harmless? The default model's accuracy with and without it.

Issue 103 keeps the embedding and the LM head in the model's dtype "unless measured harmless". On
an 8B-shaped model the bf16 head is 1.05 GB of a decode step's 8.03 GB (0.25 ms at the copy rate),
so an e4m3 head would take about 0.12 ms off each step. This probe loads the default model (fp32,
CPU) twice, unquantized and with ``quantization="fp8"`` (the projections W8A8, as served), prefills
each of ten texts (``fp8_products_accuracy.TEXTS``), and computes the logits of the FP8 model's
final hidden states through the head three ways: as served (fp32), with the head's rows quantized
like a projection's (``fp8.quantize_rows``: per-row scales) and x unquantized (W8A16), and with x
quantized per token too (W8A8). Each is compared with the unquantized model's logits at the same
positions: top-1 agreement and mean KL, over every position.

    PYTHONPATH=. python -m benchmarks.probes.fp8_head_accuracy [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import run_info
from benchmarks.probes.fp8_products_accuracy import TEXTS


def hidden(model, ids: list[int], bs: int = 16) -> torch.Tensor:
    """The model's final hidden states (the head's input) of one prompt, prefilled whole."""
    from prefixserve.attention.backend import make_backend
    from prefixserve.attention.metadata import build_metadata
    from prefixserve.kv.cache import KVCache

    n = len(ids)
    cache = KVCache(model.config, -(-n // bs) + 1, bs, torch.float32, torch.device("cpu"))
    meta = build_metadata(bs, [n], [n], [list(range(-(-n // bs)))], "cpu")
    backend = make_backend("cascade")
    backend.prepare(meta)
    return model(torch.tensor(ids), torch.arange(n), cache.layers, meta, backend)


def default_models() -> tuple[Any, Any, Any]:
    """The default model (fp32, CPU) unquantized and with ``quantization="fp8"``, and its tokenizer."""
    from prefixserve.model.loader import load_model, load_tokenizer, resolve_model

    source = resolve_model(None)
    plain, directory = load_model(source, torch.float32, torch.device("cpu"), progress=False)
    quant, _ = load_model(source, torch.float32, torch.device("cpu"), progress=False, quantization="fp8")
    return plain, quant, load_tokenizer(directory)


def main() -> None:
    from prefixserve.model import fp8

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    plain, quant, tok = default_models()
    codes, scale = fp8.quantize_rows(quant.lm_head.weight.detach())
    modes = {
        "projections W8A8, head as served": lambda h: quant.compute_logits(h),
        "+ head W8A16": lambda h: fp8.reference(h, codes, scale, act=None),
        "+ head W8A8": lambda h: fp8.reference(h, codes, scale, act="dynamic"),
    }
    agree = {m: 0.0 for m in modes}
    kl = {m: 0.0 for m in modes}
    positions = 0
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            want = F.log_softmax(plain.compute_logits(hidden(plain, ids)).float(), -1)
            h = hidden(quant, ids)
            for mode, head in modes.items():
                got = F.log_softmax(head(h).float(), -1)
                agree[mode] += float((got.argmax(-1) == want.argmax(-1)).sum())
                kl[mode] += float((want.exp() * (want - got)).sum(-1).sum())
            positions += len(ids)
    rows = [{"mode": m, "top1": agree[m] / positions, "mean_kl": kl[m] / positions} for m in modes]
    print(f"{positions} positions of {len(TEXTS)} texts, against the unquantized model")
    print("| mode | top-1 | mean KL |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['top1']:.3f} | {r['mean_kl']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(), "positions": positions, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
