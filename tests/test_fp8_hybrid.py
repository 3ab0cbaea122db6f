"""FP8 weights on linear-attention hybrids (CPU): ``quantization="fp8"`` quantizes the Gated DeltaNet
layers' input and output projections and the gated attention's q/k/v/gate (``linear.Projection``)
beside the MLPs'; a published block-FP8 checkpoint of Qwen3.5 or Qwen3-Next loads with its codes
kept where the loader stacks parts as stored, and quantized again per channel where it reorders
rows across the 128-row scale blocks (Qwen3.5's gated q/k/v, Qwen3-Next's regrouped input
projection): each layer's weight then within e4m3's half ulp of the checkpoint's dequantized one.
(A tiny random model's logits amplify FP8's noise too much for a model-level bound: quantizing its
MLPs alone moved them by 0.55 of their largest; each layer's product is within its bound.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixserve import SamplingParams
from prefixserve.model import fp8, linear
from prefixserve.model.gated_attention import GatedQKV
from prefixserve.model.gated_delta import InProj
from prefixserve.model.loader import ModelSource, load_model
from tests import fp8_checkpoints as ckpt
from tests.conftest import assert_pool_empty
from tests.test_model_families import _llm, _prompt, prefill_logits

pytest.importorskip("transformers.models.qwen3_5", reason="this transformers has no Qwen3.5")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj")
PROJECTIONS += ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba")


def _load(directory: Path, quantization: str | None = None):
    model, _ = load_model(
        ModelSource("hf", directory, str(directory)),
        torch.float32,
        torch.device("cpu"),
        quantization=quantization,
    )
    return model


def _block_fp8(source: Path, root: Path, unquantized: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """``source``'s projections (experts' and routers' aside, and those named in ``unquantized``) as
    block FP8, and the same model with the stored values dequantized: (the FP8 checkpoint, its
    dequantized twin)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    quant, dense = {}, {}
    for name, t in tensors.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if t.dim() == 2 and leaf in PROJECTIONS and leaf not in unquantized and ".experts." not in name:
            parts = ckpt._quantize("fp8-block", t.float())
            dense[name] = ckpt.dequantized("fp8-block", parts)
            base = name.removesuffix(".weight")
            quant.update({f"{base}.{k}": v for k, v in parts.items()})
        else:
            dense[name] = quant[name] = t
    config = json.loads((source / "config.json").read_text())
    out = []
    for tag, weights, qc in (("fp8", quant, ckpt.QUANT_CONFIGS["fp8-block"]), ("dense", dense, None)):
        directory = root / tag
        directory.mkdir()
        (directory / "config.json").write_text(
            json.dumps({**config, **({"quantization_config": qc} if qc else {})})
        )
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
        out.append(directory)
    return out[0], out[1]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_quantization_fp8_covers_the_hybrid_projections(family: str, tmp_path: Path) -> None:
    from tests.test_hybrid_families import tiny_checkpoint

    tiny_checkpoint(family, tmp_path)
    model, plain = _load(tmp_path, "fp8"), _load(tmp_path)
    layers = dict(linear.quantized_layers(model))
    kinds = {type(m) for m in layers.values()}
    assert {InProj, GatedQKV, linear.Projection} <= kinds and all(fp8.is_fp8(m) for m in layers.values())
    for name, layer in layers.items():  # per channel: each weight within half an ulp (or a subnormal step)
        w, got = plain.get_submodule(name).weight, fp8.dequantize(layer.weight, layer.weight_scale)
        bound = 2.0**-4 * w.abs() + 2.0**-10 * layer.weight_scale.expand_as(w) + 1e-7
        assert ((got - w).abs() <= bound).all(), name
    # through the engine: the same greedy tokens with shared-prefix attention and prefix-cache hits
    # (resumed from state snapshots) as per sequence without the cache
    prefix = _prompt(5, 70)
    prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for attention, caching in (("cascade", True), ("reference", False)):
        llm = _llm(tmp_path, quantization="fp8", attention=attention, enable_prefix_caching=caching)
        llm.generate(prompts[:1], greedy)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
        assert_pool_empty(llm)
    assert outs[0] == outs[1]
    assert llm.engine.runner.model.get_submodule(next(iter(layers))).weight.dtype == fp8.FP8


@pytest.mark.parametrize(
    ("family", "unquantized"),
    [("qwen3_5_text", ()), ("qwen3_next", ()), ("qwen3_5_text", ("in_proj_b", "in_proj_a"))],
)
def test_a_block_fp8_hybrid_checkpoint_loads(
    family: str, unquantized: tuple[str, ...], tmp_path: Path
) -> None:
    """The last case publishes the input projection's b and a rows unquantized (as vLLM builds them):
    the stacked layer is quantized whole from the loaded values, not refused."""
    from tests.test_hybrid_families import tiny_checkpoint

    tiny_checkpoint(family, tmp_path / "source")
    quant, dense = _block_fp8(tmp_path / "source", tmp_path, unquantized)
    mq, md = _load(quant), _load(dense)
    layers = dict(linear.quantized_layers(mq))
    assert layers and all(fp8.is_fp8(m) and fp8.weight_only(m) for m in layers.values())  # block scales
    reordered = {GatedQKV} | ({InProj} if family == "qwen3_next" or unquantized else set())
    for name, layer in layers.items():
        got, want = fp8.dequantize(layer.weight, layer.weight_scale), md.get_submodule(name).weight
        if type(layer) in reordered:  # quantized again per channel from the stored values
            bound = 2.0**-4 * want.abs() + 2.0**-10 * layer.weight_scale.expand_as(want) + 1e-7
            assert ((got - want).abs() <= bound).all(), name
        else:  # the stored codes and scales, as written
            assert torch.equal(got, want), name
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        assert prefill_logits(mq, ids).isfinite().all()
