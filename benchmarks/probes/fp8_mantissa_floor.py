"""Probe: how much top-1 agreement does a float format of m mantissa bits leave the default model?

Issue 103 asks FP8 weights (and W8A8) to keep next-token top-1 agreement >= 97% and mean KL <= 0.02
against the unquantized model. e4m3 keeps 3 mantissa bits. This probe separates the format from our
scheme: it rounds the same projections ``--quantization fp8`` quantizes (``linear.quantized_layers``)
to m mantissa bits, round to nearest even, with no exponent limit (no scale, no range, no
subnormals: the best any per-element format of m bits could do, whatever its scales), weights
alone and weights with each projection's input rounded alike (the W8A8 case), for several m; beside
it the FP8 model as served (W8A8, per-token e4m3 activations) and weight-only (W8A16). The default
model (SmolLM2-135M, fp32, CPU) prefills the test's text (``tests/test_fp8_weights.py``, 200
positions) and ten others (``fp8_products_accuracy.TEXTS``); every position's logits are compared
with the unquantized model's: top-1 agreement and mean KL, per text set.

    PYTHONPATH=. python -m benchmarks.probes.fp8_mantissa_floor [--bits 2 3 4 5 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from benchmarks.harness import run_info
from benchmarks.probes.fp8_head_accuracy import default_models, hidden
from benchmarks.probes.fp8_products_accuracy import TEXTS

# the text of tests/test_fp8_weights.py's accuracy test (which imports it; 200 positions)
TEST_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Books became cheaper, literacy spread across Europe, and scientists could share results "
    "quickly. In the kitchen, bread rises because yeast ferments sugars and releases carbon "
    "dioxide, which the gluten network traps. A simple Python function that adds two numbers is "
    "def add(a, b): return a + b. The capital of France is Paris, and the river that runs through "
    "it is the Seine. Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; "
    "the chlorophyll in leaves absorbs red and blue light and reflects green, which is why plants "
    "look green to us. Mountains form where tectonic plates collide, and rivers carve valleys. "
    "A good night's sleep helps memory: during deep sleep the brain replays what it learned in the "
    "day. To boil an egg, place it in boiling water for seven minutes, then cool it in cold water "
    "so the shell comes off easily. The train to Berlin leaves at nine in the morning from platform "
    "four, and the journey takes about six hours."
)


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` mantissa bits (bits + 1 significant), to nearest even, any exponent."""
    mant, exp = torch.frexp(x.float())  # mant in [0.5, 1)
    step = 2.0 ** (bits + 1)
    return torch.ldexp(torch.round(mant * step) / step, exp).to(x.dtype)


@contextlib.contextmanager
def rounded_inputs(layers: list[torch.nn.Module], bits: int) -> Iterator[None]:
    """Within the block, each layer's input is rounded to ``bits`` mantissa bits first."""
    handles = [
        m.register_forward_pre_hook(lambda _, args: (round_mantissa(args[0], bits), *args[1:]))
        for m in layers
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def compare(
    run: Callable[[list[int]], torch.Tensor], wants: list[torch.Tensor], prompts: list[list[int]]
) -> dict:
    """Top-1 agreement and mean KL of ``run``'s logits against ``wants``, over every position."""
    agree = kl = 0.0
    positions = 0
    for ids, want in zip(prompts, wants, strict=True):
        got = F.log_softmax(run(ids).float(), -1)
        agree += float((got.argmax(-1) == want.argmax(-1)).sum())
        kl += float((want.exp() * (want - got)).sum(-1).sum())
        positions += len(ids)
    return {"top1": agree / positions, "mean_kl": kl / positions, "positions": positions}


def main() -> None:
    from prefixserve.model import linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 5, 7], help="mantissa bits (e4m3: 3)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    plain, quant, tok = default_models()
    sets = {
        "test text": [tok(TEST_TEXT)["input_ids"][:200]],
        "ten texts": [tok(t)["input_ids"] for t in TEXTS],
    }
    layers = [m for _, m in linear.quantized_layers(plain)]
    originals = [m.weight.detach().clone() for m in layers]

    def logits(model) -> Callable[[list[int]], torch.Tensor]:
        return lambda ids: model.compute_logits(hidden(model, ids))

    rows = []
    with torch.no_grad():
        wants = {
            name: [F.log_softmax(logits(plain)(ids).float(), -1) for ids in prompts]
            for name, prompts in sets.items()
        }

        def record(mode: str, bits: int | None, run: Callable[[list[int]], torch.Tensor]) -> None:
            for name, prompts in sets.items():
                rows.append({"mode": mode, "bits": bits, "texts": name, **compare(run, wants[name], prompts)})
                r = rows[-1]
                print(f"{mode:>34} {name:>9}: top-1 {r['top1']:.3f}, mean KL {r['mean_kl']:.4f}", flush=True)

        record("FP8 as served (W8A8)", 3, logits(quant))
        for _, layer in linear.quantized_layers(quant):
            layer.act_quant = "none"
        record("FP8 weight-only (W8A16)", 3, logits(quant))
        for bits in args.bits:
            for layer, weight in zip(layers, originals, strict=True):
                layer.weight.copy_(round_mantissa(weight, bits))
            record(f"weights at {bits} bits", bits, logits(plain))
            with rounded_inputs(layers, bits):
                record(f"weights and inputs at {bits} bits", bits, logits(plain))
        for layer, weight in zip(layers, originals, strict=True):
            layer.weight.copy_(weight)
    print("\n| mode | texts | top-1 | mean KL |\n| --- | --- | ---: | ---: |")
    for r in rows:
        where = f"{r['texts']} ({r['positions']} positions)"
        print(f"| {r['mode']} | {where} | {r['top1']:.3f} | {r['mean_kl']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
