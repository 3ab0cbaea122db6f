"""The fused dense path against the unfused model it replaced, and its stacked weights from every loader.

The unfused model is written out below from the fused model's own weights (separate q/k/v and
gate/up matmuls, residual adds apart from the norms, RoPE through ``torch.cat``, per layer): the two
agree to 1e-5 in fp32 on the CPU (the torch path), and to bf16 tolerance on a GPU, where the Triton
kernels run (also inside a CUDA graph). HF directories (Llama; Qwen2 with its q/k/v bias) load into
the stacked weights and give HF's logits; dummy weights are the unfused model's, draw for draw.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prefixserve.attention.backend import make_backend
from prefixserve.attention.metadata import AttentionMetadata, build_metadata
from prefixserve.kv.cache import KVCache
from prefixserve.model import decode_split, fused
from prefixserve.model.config import ModelConfig
from prefixserve.model.llama import LlamaForCausalLM
from prefixserve.model.loader import ModelSource, load_model
from tests.conftest import TINY_CONFIG

BLOCK = 4


def _tiny(bias: bool, dtype: torch.dtype, device: str, tmp_path: Path) -> LlamaForCausalLM:
    cfg = dict(TINY_CONFIG, attention_bias=bias, vocab_size=512)
    path = tmp_path / f"tiny-{bias}.json"
    path.write_text(json.dumps(cfg))
    model, _ = load_model(ModelSource("dummy", path, "tiny"), dtype, torch.device(device))
    if bias:  # dummy biases are zeros: give them values so that they count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0.0, 0.5)
    return model


def _unfused_forward(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The model as it was before fusion, from the fused model's weights."""
    backend = make_backend("reference")
    backend.prepare(meta)
    tokens = ids.shape[0]

    def norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)

    freqs = positions.float()[:, None] * model.rotary.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def part(linear: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        rows = linear.part_rows()[name]
        bias = None if linear.bias is None else linear.bias[rows]
        return F.linear(x, linear.weight[rows], bias)

    h = model.model.embed_tokens(ids)
    for layer, (k_cache, v_cache) in zip(model.model.layers, kv_layers, strict=True):
        attn = layer.self_attn
        x = norm(layer.input_layernorm, h)
        q = rope(part(attn.qkv_proj, "q_proj", x).view(tokens, attn.num_heads, attn.head_dim))
        k = rope(part(attn.qkv_proj, "k_proj", x).view(tokens, attn.num_kv_heads, attn.head_dim))
        v = part(attn.qkv_proj, "v_proj", x).view(tokens, attn.num_kv_heads, attn.head_dim)
        k_cache.view(-1, attn.num_kv_heads, attn.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, attn.num_kv_heads, attn.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = backend.forward(q, k_cache, v_cache, meta, attn.scale)
        h = h + attn.o_proj(out.reshape(tokens, -1))
        x = norm(layer.post_attention_layernorm, h)
        gate_up = layer.mlp.gate_up_proj
        h = h + layer.mlp.down_proj(F.silu(part(gate_up, "gate_proj", x)) * part(gate_up, "up_proj", x))
    return norm(model.model.norm, h)


def _steps(device: str) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """A prefill of two sequences (7 and 12 tokens), then one decode step of both."""
    gen = torch.Generator().manual_seed(0)
    lens = [7, 12]
    tables = [[0, 1, 2], [3, 4, 5, 6]]
    ids = torch.randint(0, 512, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    prefill = (ids, positions, build_metadata(BLOCK, lens, lens, tables, device))
    decode_ids = torch.randint(0, 512, (2,), generator=gen)
    decode = (
        decode_ids,
        torch.tensor(lens),
        build_metadata(BLOCK, [1, 1], [n + 1 for n in lens], tables, device),
    )
    return [(i.to(device), p.to(device), m) for i, p, m in [prefill, decode]]


def _run_both(
    model: LlamaForCausalLM, device: str, reference: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(the model's output, the unfused model's) per step, then both K/V caches; ``reference``
    False: the model alone (an FP8 one, which the unfused model cannot run), None beside it."""
    dtype = next(model.parameters()).dtype  # the embedding's: the model's dtype (FP8 keeps it)
    caches = [KVCache(model.config, 8, BLOCK, dtype, torch.device(device)) for _ in range(2)]
    backend = make_backend("reference")
    outs = []
    for ids, positions, meta in _steps(device):
        backend.prepare(meta)
        got = model(ids, positions, caches[0].layers, meta, backend)
        ref = None
        if reference:
            with torch.inference_mode():
                ref = _unfused_forward(model, ids, positions, caches[1].layers, meta)
        outs.append((got, ref))
    outs.append((caches[0].tensor, caches[1].tensor))
    return outs


@pytest.mark.parametrize("bias", [False, True])
def test_fused_model_matches_unfused_fp32(bias: bool, tmp_path: Path) -> None:
    model = _tiny(bias, torch.float32, "cpu", tmp_path)
    for got, ref in _run_both(model, "cpu"):  # prefill, decode, then the KV caches they wrote
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_layer_apis_keep_their_meaning(tmp_path: Path) -> None:
    """``project`` gives RoPE'd q, k and v; ``forward(write_kv=False)`` leaves the cache alone; the
    norm takes a residual or not; ``layer_kv`` runs on the fused layers."""
    model = _tiny(True, torch.float32, "cpu", tmp_path)
    (ids, positions, meta), _ = _steps("cpu")
    attn = model.model.layers[0].self_attn
    x = torch.randn(ids.shape[0], model.config.hidden_size)
    q, k, v = attn.project(x, positions, model.rotary)
    rows = attn.qkv_proj.part_rows()
    q_ref = F.linear(x, attn.qkv_proj.weight[rows["q_proj"]], attn.qkv_proj.bias[rows["q_proj"]])
    k_ref = F.linear(x, attn.qkv_proj.weight[rows["k_proj"]], attn.qkv_proj.bias[rows["k_proj"]])
    q_rot, k_rot = model.rotary(q_ref.view_as(q), k_ref.view_as(k), positions)
    torch.testing.assert_close(q, q_rot, rtol=0, atol=0)
    torch.testing.assert_close(k, k_rot, rtol=0, atol=0)
    assert v.shape == k.shape and q.is_contiguous() and k.is_contiguous()
    cache = KVCache(model.config, 8, BLOCK, torch.float32, torch.device("cpu"))
    backend = make_backend("reference")
    backend.prepare(meta)
    with torch.inference_mode():
        attn(x, positions, model.rotary, cache.layers[0], meta, backend, write_kv=False)
    assert not cache.tensor.any()
    norm = model.model.layers[0].input_layernorm
    plain = norm(x)
    normed, summed = norm(x, x)
    torch.testing.assert_close(summed, 2 * x)
    torch.testing.assert_close(normed, norm(2 * x), rtol=0, atol=0)
    assert plain.shape == x.shape
    k1, v1 = model.layer_kv(ids, positions, cache.layers, meta, backend)
    assert k1.shape == v1.shape == (ids.shape[0], model.config.num_key_value_heads, model.config.head_dim)


def test_dummy_weights_are_the_unfused_models(tmp_path: Path) -> None:
    """Stacked weights draw their parts in the unfused order: same seed, same model as before."""
    model = _tiny(False, torch.float32, "cpu", tmp_path)
    gen = torch.Generator().manual_seed(0)
    cfg = model.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def draw(*shape: int) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)

    assert torch.equal(model.model.embed_tokens.weight, draw(cfg.vocab_size, hidden))
    for layer in model.model.layers:
        qkv = torch.cat([draw(q_rows, hidden), draw(kv_rows, hidden), draw(kv_rows, hidden)])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.self_attn.o_proj.weight, draw(hidden, q_rows))
        assert torch.equal(
            layer.mlp.gate_up_proj.weight, torch.cat([draw(inter, hidden), draw(inter, hidden)])
        )
        assert torch.equal(layer.mlp.down_proj.weight, draw(hidden, inter))
    assert torch.equal(model.lm_head.weight, draw(cfg.vocab_size, hidden))


def _hf_dir(arch: str, tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    kwargs = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if arch == "qwen2":
        config, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    if arch == "qwen2":  # HF initialises the biases to zero: give them values
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    directory = tmp_path / arch
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_directories_load_into_stacked_weights(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    directory = _hf_dir(arch, tmp_path)
    model, _ = load_model(ModelSource("hf", directory, arch), torch.float32, torch.device("cpu"))
    assert model.config.attention_bias == (arch == "qwen2")
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    (ids, positions, meta), _ = _steps("cpu")
    lens = [7, 12]
    cache = KVCache(model.config, 8, BLOCK, torch.float32, torch.device("cpu"))
    backend = make_backend("reference")
    backend.prepare(meta)
    logits = model.compute_logits(model(ids, positions, cache.layers, meta, backend))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    start = 0
    for n in lens:
        with torch.no_grad():
            ref = hf(ids[start : start + n][None]).logits[0]
        torch.testing.assert_close(logits[start : start + n], ref, rtol=1e-4, atol=1e-4)
        start += n


def test_stacked_checkpoints_load_and_missing_parts_are_named(tmp_path: Path) -> None:
    """A checkpoint that already stacks (qkv_proj, gate_up_proj) loads as it is; a missing part fails."""
    from safetensors.torch import save_file

    model = _tiny(True, torch.float32, "cpu", tmp_path)
    directory = tmp_path / "stacked"
    directory.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    raw = ModelConfig.to_hf_dict(model.config)
    (directory / "config.json").write_text(json.dumps(raw))
    again, _ = load_model(ModelSource("hf", directory, "stacked"), torch.float32, torch.device("cpu"))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    hf_dir = _hf_dir("llama", tmp_path)
    from safetensors.torch import load_file

    weights = load_file(str(hf_dir / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(hf_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.self_attn.k_proj.weight'\]"):
        load_model(ModelSource("hf", hf_dir, "broken"), torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_triton_dense_path_matches_unfused_on_gpu(bias: bool, tmp_path: Path) -> None:
    """bf16 on CUDA: the Triton kernels against the unfused model and against the fused torch path."""
    model = _tiny(bias, torch.bfloat16, "cuda", tmp_path)
    with fused.triton_kernels(True):
        triton_outs = _run_both(model, "cuda")
    with fused.triton_kernels(False):
        torch_outs = _run_both(model, "cuda")
    _assert_both_near_unfused(triton_outs, torch_outs)


def _assert_both_near_unfused(
    outs: list[tuple[torch.Tensor, torch.Tensor]], other_outs: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Each of two ``_run_both`` runs within bf16 tolerance of the unfused model (relative norm)."""
    for (got, ref), (other, _) in zip(outs, other_outs, strict=True):
        for a in (got, other):
            err = (a.float() - ref.float()).norm() / ref.float().norm()
            assert err < 2e-2, float(err)


def _skip_without_split_k() -> None:
    from prefixserve.model.kernels import skinny_matmul

    if not (skinny_matmul.hopper(torch.device("cuda")) and fused._bmm_takes_out_dtype()):
        pytest.skip("the split-K rules take Hopper GPUs with torch.bmm(out_dtype=) only")


def _assert_split_k_matches_one_matmul(model: LlamaForCausalLM) -> None:
    """The model's runs with the split-K rules on and off: both near the unfused model, and near
    each other (bf16)."""
    with fused.split_k_products(True):
        split_outs = _run_both(model, "cuda")
    with fused.split_k_products(False):
        plain_outs = _run_both(model, "cuda")
    _assert_both_near_unfused(split_outs, plain_outs)
    for (got, _), (plain, _) in zip(split_outs, plain_outs, strict=True):
        assert ((got.float() - plain.float()).norm() / plain.float().norm()) < 1e-2


@pytest.mark.gpu
def test_split_k_down_projection_matches_one_matmul_on_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the rule taking every down projection (the tiny model's K = 128, 2 slices), the model
    hands the next norm fp32 partials; outputs match the one-matmul path and the unfused model."""
    _skip_without_split_k()
    monkeypatch.setattr(fused, "SPLIT_K_MIN_K", 128)
    monkeypatch.setattr(fused, "SPLIT_K_ROWS", [(1, 1 << 20, 2)])
    model = _tiny(False, torch.bfloat16, "cuda", tmp_path)
    act = torch.zeros(5, 128, device="cuda", dtype=torch.bfloat16)
    assert fused.split_k_for(act, model.model.layers[0].mlp.down_proj.weight) == 2
    assert model.model.layers[0].mlp(torch.randn(5, 64, device="cuda").bfloat16(), partials=True).dim() == 3
    _assert_split_k_matches_one_matmul(model)


@pytest.mark.gpu
def test_split_k_qkv_projection_matches_one_matmul_on_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the rule taking every qkv projection (the tiny model's K = 64: one slice, so the RoPE
    kernel still takes [1, T, W] fp32 partials and rounds them), outputs and the K/V written match
    the one-matmul path and the unfused model."""
    _skip_without_split_k()
    monkeypatch.setattr(fused, "QKV_SPLIT_K_ROWS", [(1, 1 << 20, 1)])
    model = _tiny(False, torch.bfloat16, "cuda", tmp_path)
    proj = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, 64, device="cuda").bfloat16()
    assert fused.qkv_partials(x, proj.weight, proj.bias).shape == (1, 5, proj.weight.shape[0])
    _assert_split_k_matches_one_matmul(model)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_decode_partials_match_one_product_on_gpu(
    quantization: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode rule's split-K partials (``decode_split.partials``: the skinny kernel's at N <=
    2,048, FP8 W8A8's at a few rows; any K here) from the o and down products of a model whose K are
    whole slices: the next norms sum them, and the outputs match the one-product path (and, bf16,
    the unfused model)."""
    _skip_without_split_k()
    monkeypatch.setattr(decode_split, "MIN_K", 0)
    cfg = dict(TINY_CONFIG, vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8)
    path = tmp_path / "tiny512.json"
    path.write_text(json.dumps(cfg))
    source = ModelSource("dummy", path, "tiny")
    model, _ = load_model(source, torch.bfloat16, torch.device("cuda"), quantization=quantization)
    layer = model.model.layers[0]
    x = torch.randn(5, 512, device="cuda").bfloat16()
    assert decode_split.partials(x, layer.self_attn.o_proj).shape == (2, 5, 512)
    assert layer.mlp(x, partials=True).shape == (2, 5, 512)
    if quantization is None:
        _assert_split_k_matches_one_matmul(model)
        return
    with fused.split_k_products(True):
        split_outs = _run_both(model, "cuda", reference=False)
    with fused.split_k_products(False):
        plain_outs = _run_both(model, "cuda", reference=False)
    for (got, _), (plain, _) in zip(split_outs, plain_outs, strict=True):
        assert ((got.float() - plain.float()).norm() / plain.float().norm()) < 1e-2


@pytest.mark.gpu
def test_triton_dense_path_replays_in_a_cuda_graph(tmp_path: Path) -> None:
    """A decode forward captured in a CUDA graph (as the engine's decode graphs do) replays exactly."""
    model = _tiny(True, torch.bfloat16, "cuda", tmp_path)
    (p_ids, p_pos, p_meta), (ids, positions, meta) = _steps("cuda")
    cache = KVCache(model.config, 8, BLOCK, torch.bfloat16, torch.device("cuda"))
    backend = make_backend("reference")
    backend.prepare(p_meta)
    model(p_ids, p_pos, cache.layers, p_meta, backend)
    embed = model.model.embed_tokens
    with torch.inference_mode():
        h = embed(ids)
        rope = model.cos_sin(positions)  # the step's Ropes, as the model's forward hands every layer
        layer = model.model.layers[0]
        eager = layer(h, None, rope, cache.layers[0], meta, _NoAttention())
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(h, None, rope, cache.layers[0], meta, _NoAttention())  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = layer(h, None, rope, cache.layers[0], meta, _NoAttention())
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(out, eager, strict=True):
        assert torch.equal(a, b)


class _NoAttention:
    """Stands in for attention inside the graph test (the engine's graphs bring their own)."""

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: object, scale: float
    ) -> torch.Tensor:
        return q
