"""Tiny FP8 checkpoints of each published format, written from the formats' definitions, beside the
same model dequantized (fp32): the FP8 tests (CPU and GPU) load both and compare.

- ``fp8-block``: ``quantization_config`` {quant_method: fp8, weight_block_size: [128, 128]} (DeepSeek-V3,
  Qwen3-FP8): ``weight`` e4m3 and ``weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)], w = code *
  scale_inv within each block.
- ``fp8-tensor-static``: {quant_method: fp8, activation_scheme: static}: one ``weight_scale`` and one
  ``input_scale`` per tensor.
- ``ct-channel-dynamic``: compressed-tensors ``float-quantized``, weights by channel (``weight_scale``
  [N, 1]), input activations dynamic per token.
- ``ct-tensor-static``: compressed-tensors, weights by tensor, input activations static by tensor.
- ``ct-channel-weight-only``: compressed-tensors, weights by channel, no activation quantization.
- ``fp8-tensor-dynamic``: {quant_method: fp8} per tensor, activations dynamic.
- ``ct-channel-static``, ``ct-tensor-dynamic``: the other pairings of weight and activation scales.
- ``ct-block``: compressed-tensors weights by ``block`` (``block_structure`` [128, 128]): one
  ``weight_scale`` a block, [ceil(N/128), ceil(K/128)], activations dynamic.
- ``ct-naive-channel-dynamic``: compressed-tensors' ``naive-quantized`` format, weights by channel, dynamic.

Each has ``ignore: ["lm_head"]`` (compressed-tensors) / an unquantized LM head, as published.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMATS = (
    "fp8-block",
    "fp8-tensor-static",
    "ct-channel-dynamic",
    "ct-tensor-static",
    "ct-channel-weight-only",
    "fp8-tensor-dynamic",
    "ct-channel-static",
    "ct-tensor-dynamic",
    "ct-block",
    "ct-naive-channel-dynamic",
)
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 256,
    "intermediate_size": 384,  # gate/up: 3 blocks of 128 rows each; down: K = 384
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8, MAX, BLOCK = torch.float8_e4m3fn, 448.0, 128


def _ct_config(weights: str, acts: str | None, form: str = "float-quantized") -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": weights, "symmetric": True, "dynamic": False},
        "input_activations": None,
    }
    if weights == "block":
        group["weights"]["block_structure"] = [BLOCK, BLOCK]
    if acts == "dynamic":
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    elif acts == "static":
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


QUANT_CONFIGS = {
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "fp8-tensor-static": {"quant_method": "fp8", "activation_scheme": "static"},
    "ct-channel-dynamic": _ct_config("channel", "dynamic"),
    "ct-tensor-static": _ct_config("tensor", "static"),
    "ct-channel-weight-only": _ct_config("channel", None),
    "fp8-tensor-dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "ct-channel-static": _ct_config("channel", "static"),
    "ct-tensor-dynamic": _ct_config("tensor", "dynamic"),
    "ct-block": _ct_config("block", "dynamic"),
    "ct-naive-channel-dynamic": _ct_config("channel", "dynamic", form="naive-quantized"),
}
BLOCK_SCALED = {"fp8-block": "weight_scale_inv", "ct-block": "weight_scale"}  # the scale's name


def _quantize(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The format's tensors for one weight w [N, K] (codes under ``weight``), its definition's way."""
    n, k = w.shape
    if fmt in BLOCK_SCALED:
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.zeros(nb * BLOCK, kb * BLOCK)
        padded[:n, :k] = w
        amax = padded.abs().view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))
        scale = amax / MAX  # [nb, kb]
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        return {"weight": (w / full).clamp(-MAX, MAX).to(FP8), BLOCK_SCALED[fmt]: scale}
    if "channel" in fmt:
        scale = w.abs().amax(dim=1, keepdim=True) / MAX  # [N, 1]
        return {"weight": (w / scale).clamp(-MAX, MAX).to(FP8), "weight_scale": scale}
    scale = w.abs().amax() / MAX  # one per tensor
    return {"weight": (w / scale).clamp(-MAX, MAX).to(FP8), "weight_scale": scale.reshape(1)}


def dequantized(fmt: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight the format's tensors stand for, fp32."""
    codes = tensors["weight"].float()
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
    n, k = codes.shape
    if fmt in BLOCK_SCALED:
        scale = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    elif scale.numel() == 1:
        scale = scale.reshape(1, 1)
    return codes * scale


def write(root: Path, fmt: str, seed: int = 0, kv_heads: int = 2) -> tuple[Path, Path]:
    """(the FP8 checkpoint's directory, the dequantized one's); ``kv_heads``: the model's KV heads."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    d = h // CONFIG["num_attention_heads"]
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv_heads * d, h),
        "self_attn.v_proj": (kv_heads * d, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    dense = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=gen),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(v, h, generator=gen) * 0.5,  # wide logit gaps: greedy is stable
    }
    quant: dict[str, torch.Tensor] = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        dense[prefix + "input_layernorm.weight"] = torch.ones(h)
        dense[prefix + "post_attention_layernorm.weight"] = torch.ones(h)
        for proj in PROJECTIONS:
            w = torch.randn(shapes[proj], generator=gen) / shapes[proj][1] ** 0.5
            parts = _quantize(fmt, w)
            dense[f"{prefix}{proj}.weight"] = dequantized(fmt, parts)
            quant.update({f"{prefix}{proj}.{k}": t for k, t in parts.items()})
            if "static" in fmt:  # a calibrated scale: the largest |x| seen, over 448
                quant[f"{prefix}{proj}.input_scale"] = torch.tensor([16.0 / MAX])
    out = []
    for name, tensors, qc in (
        (fmt, {**{k: t for k, t in dense.items() if k not in _weights(quant)}, **quant}, QUANT_CONFIGS[fmt]),
        (fmt + "-dequantized", dense, None),
    ):
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(CONFIG, num_key_value_heads=kv_heads, **({"quantization_config": qc} if qc else {}))
        (directory / "config.json").write_text(json.dumps(config))
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / "model.safetensors"))
        out.append(directory)
    return out[0], out[1]


def _weights(quant: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in quant if k.endswith(".weight")}
