"""Probe: what FP8 tensor-core products would cost the default model's accuracy over an FP8 KV cache.

Issue 103 asks for the shared segment's Q K^T and P V on FP8 tensor cores "where it passes the accuracy
bounds" (next-token top-1 agreement >= 97% with the full-precision cache, mean KL <= 0.02). Those
products take both operands in e4m3: q rounded per (row, head) to e4m3 with its own scale (amax /
448) for Q K^T (or as two e4m3 terms, the second the first's rounding residual: two FP8 products
into one accumulator), and the probabilities P rounded to e4m3 (scaled by 448, so values down to ~4e-6 stay
normal or subnormal instead of flushing below 2^-9) for P V. This probe runs the engine's layers on
the CPU over an e4m3 cache (K turned, scales calibrated at start, as the engine stores them),
prompts in 32-token chunks so every position reads cached e4m3 K/V, and swaps the reference
attention for one that rounds q and / or P the way such a kernel would; every other number is fp32.
Against the fp32 cache it reports each mode's top-1 agreement and mean KL over every position.
Every layer's attention is rounded here (the engine would round only the shared part's): an upper
bound on the loss.

    PYTHONPATH=. python -m benchmarks.probes.fp8_products_accuracy [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import run_info

E4M3_MAX = 448.0
BLOCK, CHUNK = 16, 32
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for wine. "
    "Within fifty years presses operated in more than two hundred cities across Europe, and the price "
    "of books fell so far that ordinary merchants could own a small library. Historians still argue "
    "about how much the press changed religion, science and politics, but few doubt that it made the "
    "exchange of ideas faster than ever before.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < "
    "len(right):\n        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n"
    "        else:\n            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
    "User: What should I pack for a three-day hiking trip in the mountains in early autumn?\nAssistant: "
    "Bring layers: a warm fleece, a waterproof jacket and a hat, since nights can drop below freezing. "
    "Pack enough food and water, a map, a headlamp, a first-aid kit and sturdy boots that are broken in.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy splits water molecules, "
    "releasing oxygen, while the energy captured is stored in ATP and NADPH. In the Calvin cycle these "
    "carriers drive the fixation of carbon dioxide into sugars, which the plant uses for growth and "
    "stores as starch. Without this process almost no life on land could exist.",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\nLEFT JOIN orders ON "
    "orders.customer_id = customers.id\nWHERE customers.created_at >= '2024-01-01'\nGROUP BY customers.name"
    "\nHAVING COUNT(orders.id) > 3\nORDER BY order_count DESC\nLIMIT 20;",
    "User: Can you explain the difference between a list and a tuple in Python?\nAssistant: Both hold "
    "ordered sequences, but a list is mutable, so you can append, remove or change its items, while a "
    "tuple cannot change after it is made. Tuples can be dictionary keys and are a little faster to "
    "create; lists suit collections that grow.",
    "The river rose slowly through the night. By morning the lower fields were under a sheet of brown "
    "water, and the farmers stood on the embankment watching their fences disappear. Nobody spoke much. "
    "They had seen floods before, and they knew the water would fall again, but the spring planting "
    "would be late and the seed would have to be bought twice.",
    "To reset the router, hold the small button on the back for ten seconds until the lights blink. "
    "Wait two minutes for it to restart, then connect to the default network printed on the label. "
    "Open a browser, go to the setup page, choose a new password and update the firmware before "
    "connecting any other devices.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours outside the lunar module, collecting rock samples and setting up "
    "experiments, while Michael Collins orbited above in the command module. The crew returned safely "
    "to Earth eight days after launch.",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
    "        self._items.append(item)\n\n    def pop(self):\n        if not self._items:\n            raise "
    "IndexError('pop from an empty stack')\n        return self._items.pop()\n\n    def __len__(self):\n"
    "        return len(self._items)\n",
]


def e4m3_rows(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """``x`` rounded to e4m3 with a scale per row of its last dimension (amax / 448), back in fp32; with
    ``terms`` 2, as the sum of two e4m3 terms at that scale (the rounding's residual rounded again: a
    kernel runs Q K^T as two FP8 products into one accumulator)."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    scaled = x / scale
    hi = scaled.to(torch.float8_e4m3fn).float()
    if terms == 2:
        hi = hi + (scaled - hi).to(torch.float8_e4m3fn).float()
    return hi * scale


def e4m3_probs(p: torch.Tensor) -> torch.Tensor:
    """Probabilities in [0, 1] rounded to e4m3 at a fixed scale of 448 (a kernel folds it into l)."""
    return (p * E4M3_MAX).to(torch.float8_e4m3fn).float() / E4M3_MAX


def rounded_sdpa(q_terms: int, round_p: bool) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` for [H, M, D] q over [Hkv, N, D] K / V (GQA), with q (in
    ``q_terms`` e4m3 terms; 0: exact) and / or the probabilities rounded as FP8 tensor-core products
    would take them."""

    def sdpa(q, k, v, attn_mask=None, scale=None, enable_gqa=False):  # torch's signature
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        if q_terms:
            q = e4m3_rows(q, q_terms)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - top)
        denom = p.sum(-1, keepdim=True)  # the sum of the exact probabilities, as a kernel keeps l
        if round_p:
            p = e4m3_probs(p)
        return torch.matmul(p, v) / denom

    return sdpa


MODES = {  # name: (q's e4m3 terms, P rounded)
    "fp8 kv, exact products": (0, False),
    "q in e4m3 (FP8 Q K^T)": (1, False),
    "P in e4m3 (FP8 P V)": (0, True),
    "both (FP8 Q K^T and P V)": (1, True),
    "q in two e4m3 terms (two FP8 Q K^T)": (2, False),
    "q in two terms and P (FP8 P V)": (2, True),
}


@torch.inference_mode()
def logits(model, ids: list[int], dtype: torch.dtype, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits at every position, in CHUNK-token steps over a cache of ``dtype``."""
    from prefixserve.attention.backend import make_backend
    from prefixserve.attention.metadata import build_metadata
    from prefixserve.kv.cache import KVCache

    blocks = -(-len(ids) // BLOCK)
    cache = KVCache(model.config, blocks, BLOCK, dtype, torch.device("cpu"))
    if scales is not None:
        cache.set_scales(scales)
    backend, table, out = make_backend("reference"), list(range(blocks)), []
    for lo in range(0, len(ids), CHUNK):
        hi = min(lo + CHUNK, len(ids))
        meta = build_metadata(BLOCK, [hi - lo], [hi], [table[: -(-hi // BLOCK)]], "cpu")
        hidden = model(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), cache.layers, meta, backend)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def default_model_fp8() -> tuple[Any, Any, torch.Tensor]:
    """The default model in fp32 on the CPU (its linear weights packed, as the engine runs them), its
    tokenizer, and the e4m3 cache's K / V scales the engine's start-up calibration gives it."""
    from prefixserve.model import cpu_linear
    from prefixserve.model.loader import load_model, load_tokenizer, resolve_model

    model, tok_dir = load_model(resolve_model(None), torch.float32, torch.device("cpu"))
    cpu_linear.pack_linear_weights(model)
    return model, load_tokenizer(tok_dir), calibrated_scales(model)


def calibrated_scales(model) -> torch.Tensor:
    """The e4m3 cache's K / V scales the engine's start-up calibration gives ``model`` (fp32, CPU)."""
    from prefixserve.kv.cache import KVCache
    from prefixserve.worker.kv_calibration import calibrate_kv_scales

    calibrated = KVCache(model.config, 1, BLOCK, torch.float8_e4m3fn, torch.device("cpu"))
    calibrate_kv_scales(model, calibrated, torch.float32)
    return calibrated.scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="docs/benchmarks/fp8_products_accuracy.json")
    args = ap.parse_args()
    from prefixserve.attention import reference

    model, tok, scales = default_model_fp8()
    prompts = [tok.encode(t) for t in TEXTS]
    refs = [logits(model, ids, torch.float32, None).log_softmax(-1) for ids in prompts]
    exact_sdpa = reference.F.scaled_dot_product_attention
    rows = []
    try:
        for name, (q_terms, round_p) in MODES.items():
            reference.F = _FunctionalWithSdpa(rounded_sdpa(q_terms, round_p))
            agree, kls = [], []
            for ids, ref in zip(prompts, refs, strict=True):
                got = logits(model, ids, torch.float8_e4m3fn, scales).log_softmax(-1)
                agree.append(ref.argmax(-1) == got.argmax(-1))
                kls.append((ref.exp() * (ref - got)).sum(-1))
            a, kl = torch.cat(agree).float(), torch.cat(kls)
            row = {"mode": name, "positions": a.numel(), "top1": float(a.mean()), "mean_kl": float(kl.mean())}
            rows.append(row)
            print(
                f"{name:28s} positions {row['positions']}  top-1 {row['top1']:.4f}  KL {row['mean_kl']:.5f}"
            )
    finally:
        reference.F = F
    assert reference.F.scaled_dot_product_attention is exact_sdpa
    record = {"info": run_info(()), "model": "SmolLM2-135M-Instruct (GGUF), fp32, CPU", "rows": rows}
    Path(args.json).write_text(json.dumps(record, indent=1))


class _FunctionalWithSdpa:
    """``torch.nn.functional`` with ``scaled_dot_product_attention`` replaced (``reference.F``)."""

    def __init__(self, sdpa: Callable[..., torch.Tensor]) -> None:
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name: str):
        return getattr(F, name)


if __name__ == "__main__":
    main()
