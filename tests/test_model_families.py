"""Each supported family against HF transformers: a tiny random checkpoint written by its config class
(odd sizes, a window shorter than the prompts) loads into prefixserve, its last-token logits match HF's
in fp32, its greedy tokens equal HF's ``generate``, and sharing a prefix longer than the window changes
no token (shared-segment attention on and off, a prefix-cache repeat, n=4 sampling groups).

Gemma 4 runs four ways: global layers with a larger head (``per_layer_config``) and per-layer inputs;
KV-shared layers, K as V with the global layers' own KV heads, and double-wide MLPs; one KV shape with
KV-shared layers (the sliding layers' pages given back); the 31B's form (K as V, no per-layer inputs).
Its cases skip where the installed transformers has no Gemma 4."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader import ModelSource, load_model
from tests.conftest import assert_pool_empty

transformers = pytest.importorskip("transformers")

WINDOW = 24  # shorter than most prompts below
VOCAB = 331
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 72,
    "intermediate_size": 100,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "pad_token_id": 0,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"num_hidden_layers": 3, "tie_word_embeddings": False},
    "qwen3_sliding": {  # Qwen3's own window rule: layers from max_window_layers on slide
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
    },
    "gemma3_text": {
        "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 20,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0,
    },
    "mistral": {"num_hidden_layers": 2, "sliding_window": WINDOW, "head_dim": 12},
    # two global layers with their own head size and KV heads, proportional RoPE, per-layer inputs
    "gemma4_text": {
        "num_hidden_layers": 5,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention", "full_attention"],
        # HF reads one RoPE per layer type: the global layers' sizes must agree
        "per_layer_config": {i: {"head_dim": 32, "num_key_value_heads": 1} for i in (2, 4)},
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "final_logit_softcapping": 30.0,
    },
    # the last three layers read layers 1 and 2's KV (double-wide MLPs); the global layers' V is their
    # K, with one KV head of 32 dims (the older global_head_dim / num_global_key_value_heads fields)
    "gemma4_shared": {
        "num_hidden_layers": 6,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 3,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
    },
    # one KV shape for every layer (the sliding layers' pages can be given back) and KV-shared layers
    "gemma4_uniform": {
        "num_hidden_layers": 6,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "global_head_dim": 16,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,  # HF's KV-shared layers need per-layer inputs (5.24)
        "vocab_size_per_layer_input": VOCAB,
    },
    # as the 31B: no per-layer inputs, K as V on the global layers, their own head size and KV heads
    "gemma4_dense": {
        "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "global_head_dim": 32,
        "num_global_key_value_heads": 3,
        "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0,
    },
}
ARCH = {"qwen3_sliding": "qwen3"} | {
    name: "gemma4_text" for name in ("gemma4_shared", "gemma4_uniform", "gemma4_dense")
}
GEMMA4 = ("gemma4_text", "gemma4_shared", "gemma4_uniform", "gemma4_dense")


def _randomize(model: torch.nn.Module) -> None:
    """HF initialises norms to ones (Gemma 3's to zeros) and biases to zeros, and Gemma 4's layer
    scalars to ones: give every tensor values, so that a norm or offset applied wrongly shows."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 0.0 if "gemma3" in type(model).__name__.lower() else 1.0  # Gemma 3's are 1 + w
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + base)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # a checkpoint tensor (persistent buffer)
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)


def tiny_checkpoint(name: str, directory: Path, **sizes: Any) -> Any:
    """A random HF model of family ``name`` (``FAMILIES``' settings over ``SIZES``, then ``sizes``),
    saved with ``save_pretrained`` into ``directory``; returns the HF model (fp32, eval)."""
    kwargs = {**SIZES, **FAMILIES[name], **sizes}
    config = transformers.AutoConfig.for_model(ARCH.get(name, name), **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(model)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    name = request.param
    if name in GEMMA4:
        pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")
    directory = tmp_path_factory.mktemp(name)
    sizes = {"head_dim": 12} if name == "mistral" else {}  # not a power of two: the CPU paths take any
    return name, directory, tiny_checkpoint(name, directory, **sizes)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def _llm(directory: Path, **kw: Any) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 160, "block_size": 8, "progress": False}
    return LLM(model=str(directory), **{**args, **kw})


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# behind a prefix of 3 windows and own parts of 3-17 tokens: from 22 tokens on, every row's last
# decode steps have windows that start past the prefix
SHARED_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_config_reads_the_layer_types(family) -> None:
    name, directory, hf = family
    config = ModelConfig.from_json(directory / "config.json")
    if name in ("gemma3_text", "qwen3_sliding", "mistral", *GEMMA4):
        assert config.has_sliding_layers
        kinds = [config.layer_spec(i).kind for i in range(config.num_hidden_layers)]
        hf_kinds = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * len(kinds)  # Mistral
        assert kinds == list(hf_kinds)
        assert {
            config.layer_spec(i).window for i in range(len(kinds)) if kinds[i] == "sliding_attention"
        } == {WINDOW}
    if name == "gemma3_text":
        assert config.layer_spec(0).rope != config.layer_spec(2).rope  # local and global RoPE
    if name in GEMMA4:  # each layer's KV shape and KV source as HF resolves them
        layers = range(config.num_hidden_layers)
        want = [(c.num_key_value_heads, c.head_dim) for c in hf.config.per_layer_config]
        assert [config.layer_kv_shape(i) for i in layers] == want
        modes = hf.config.kv_sharing_modes
        assert [config.kv_source(i) != i for i in layers] == [m == "reuse" for m in modes]
        for i in layers:  # a shared layer reads the last producer of its type before the shared ones
            if modes[i] == "reuse":
                source = config.kv_source(i)
                assert modes[source] == "store" and kinds[source] == kinds[i]
        assert config.layer_spec(0).rope != config.layer_spec(config.num_hidden_layers - 1).rope


def prefill_logits(model: Any, ids: list[int], backend_name: str = "cascade", bs: int = 8) -> torch.Tensor:
    """Every position's logits of one prompt run as one prefill on ``backend_name`` (fp32, CPU)."""
    from prefixserve.attention.backend import make_backend
    from prefixserve.attention.metadata import build_metadata
    from prefixserve.kv.cache import KVCache

    length = len(ids)
    cache = KVCache(model.config, -(-length // bs) + 1, bs, torch.float32, torch.device("cpu"))
    meta = build_metadata(bs, [length], [length], [list(range(-(-length // bs)))], "cpu")
    backend = make_backend(backend_name)
    backend.prepare(meta)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(length), cache.layers, meta, backend))


def assert_logits_match_hf(family, lengths: tuple[int, ...]) -> None:
    """The family's last-token logits within 1e-4 of HF's in fp32, on two backends, for each length
    of prompt (shared by the model tests of every part: ``tests/test_hybrid_families.py``)."""
    name, directory, hf = family
    model, _ = load_model(ModelSource("hf", directory, name), torch.float32, torch.device("cpu"))
    for length in lengths:
        ids = _prompt(length, length)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1:]
        for backend_name in ("reference", "cascade"):
            logits = prefill_logits(model, ids, backend_name)[-1:]
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_logits_match_hf(family) -> None:
    assert_logits_match_hf(family, (9, 3 * WINDOW + 5))  # shorter than the window, and longer


def _hf_generate(hf: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_equal_hf_generate(family) -> None:
    _, directory, hf = family
    prompts = [_prompt(1, 10), _prompt(2, 2 * WINDOW + 3)]
    expected = [_hf_generate(hf, p) for p in prompts]
    for attention in ("reference", "cascade"):
        llm = _llm(directory, attention=attention)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected, attention
        assert_pool_empty(llm)


def test_sharing_a_prefix_longer_than_the_window_changes_no_token(family) -> None:
    """8 prompts behind one prefix of 3 windows: shared-segment attention and the prefix cache on, off,
    a repeat served from the cache, and n=4 seeded sampling groups, all the same tokens."""
    _, directory, _ = family
    prefix = _prompt(5, 3 * WINDOW)
    prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(8)]
    plain = _llm(directory, attention="reference", enable_prefix_caching=False)
    shared = _llm(directory, attention="cascade", max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, SHARED_GREEDY)]
    first = shared.generate(prompts, SHARED_GREEDY)
    again = shared.generate(prompts, SHARED_GREEDY)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    metrics = shared.metrics()
    assert metrics["prefix_cache_hit_tokens_total"] >= 8 * (len(prefix) // 8 * 8) - 8
    assert metrics["attention_kv_tokens_read_total"] < metrics["attention_kv_tokens_logical_total"]
    group = SamplingParams(temperature=0.8, n=4, seed=3, max_tokens=12, ignore_eos=True)
    samples = [[c.token_ids for c in o.outputs] for o in shared.generate(prompts[:2], group)]
    assert samples == [[c.token_ids for c in o.outputs] for o in plain.generate(prompts[:2], group)]
    assert_pool_empty(shared)
    assert_pool_empty(plain)


BAD_CONFIGS = [
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "supported layer types"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window is None"),
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'; supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic'"),
]


@pytest.mark.parametrize(("change", "message"), BAD_CONFIGS)
def test_self_contradicting_configs_are_refused_by_name(
    change, message, tmp_path: Path, tiny_config_path
) -> None:
    from tests.conftest import TINY_CONFIG

    raw = {**TINY_CONFIG, **change}
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict(raw)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(model=f"dummy:{path}", device="cpu", dtype="float32", progress=False)
    # an engine that was serving goes on serving
    tiny_llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", dtype="float32", progress=False)
    out = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


def gguf_writer(cfg: Any, path: Path, arch: str) -> Any:
    """A GGUF writer for ``arch`` with the sizes of the HF config ``cfg`` written, as llama.cpp does."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def _write_qwen3_gguf(hf: Any, path: Path) -> None:
    """The tiny checkpoint as llama.cpp writes a Qwen3 GGUF (f32 tensors, q and k as they are)."""
    writer = gguf_writer(hf.config, path, "qwen3")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
    names |= {"self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm"}
    names |= {"self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm"}
    names |= {"post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    names |= {"mlp.down_proj": "ffn_down"}
    for name, tensor in hf.state_dict().items():
        parts = name.split(".")
        if parts[1] == "layers":
            gguf_name = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }
            gguf_name = gguf_name.get(name, "output.weight")
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_gguf_reads_as_the_checkpoint(family, tmp_path: Path) -> None:
    """A Qwen3 GGUF (llama.cpp's tensor names, q and k not permuted) reads into the same weights and
    config as the HF checkpoint, and the model built from it gives HF's logits."""
    name, _, hf = family
    if name != "qwen3":
        pytest.skip("the GGUF family under test is Qwen3")
    from prefixserve.model.gguf_reader import iter_gguf_weights, load_gguf

    path = tmp_path / "tiny-qwen3.gguf"
    _write_qwen3_gguf(hf, path)
    reader, config = load_gguf(path)
    assert (config.architecture, config.qk_norm, config.head_dim) == ("qwen3", True, hf.config.head_dim)
    weights = dict(iter_gguf_weights(reader, config))
    expected = hf.state_dict()
    assert set(weights) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(weights[key], tensor.float()), key
    # what the conversion cache holds (``loader.convert_gguf``): the weights and the config it writes
    from safetensors.torch import save_file

    converted = tmp_path / "converted"
    converted.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(converted / "model.safetensors"))
    (converted / "config.json").write_text(json.dumps(config.to_hf_dict()))
    model, _ = load_model(ModelSource("hf", converted, "tiny-qwen3"), torch.float32, torch.device("cpu"))
    assert model.config == config
    ids = _prompt(3, 20)
    from prefixserve.attention.backend import make_backend
    from prefixserve.attention.metadata import build_metadata
    from prefixserve.kv.cache import KVCache

    cache = KVCache(model.config, 4, 8, torch.float32, torch.device("cpu"))
    meta = build_metadata(8, [20], [20], [[0, 1, 2]], "cpu")
    backend = make_backend("reference")
    backend.prepare(meta)
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(20), cache.layers, meta, backend))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 as published (``Gemma3ForConditionalGeneration``: ``text_config``, the language model's
    tensors under ``language_model.``, a vision tower beside them) loads as its text model: the
    vision tensors are left, and text prompts give HF's logits and greedy tokens."""
    text = {**SIZES, **FAMILIES["gemma3_text"]}
    text = {k: v for k, v in text.items() if k not in ("pad_token_id",)}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 28, "patch_size": 14}
    config = transformers.AutoConfig.for_model(
        "gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(hf)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert any(k.startswith("vision_tower.") for k in f.keys())  # noqa: SIM118
    model, _ = load_model(ModelSource("hf", tmp_path, "gemma3-mm"), torch.float32, torch.device("cpu"))
    assert model.config.architecture == "gemma3" and model.config.has_sliding_layers
    ids = _prompt(7, 2 * WINDOW + 3)
    llm = _llm(tmp_path, attention="cascade")
    got = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
        )
    assert got == out[0, len(ids) :].tolist()


def test_a_multimodal_gemma4_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 4 as published (``Gemma4ForConditionalGeneration``: ``text_config``, the language model
    under ``model.language_model.``, vision and audio towers and their projections beside it) loads as
    its text model, KV-shared layers and per-layer inputs included: text prompts give HF's tokens."""
    pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")
    text = {k: v for k, v in {**SIZES, **FAMILIES["gemma4_shared"]}.items() if k != "pad_token_id"}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"num_key_value_heads": 2, "head_dim": 8, "patch_size": 4, "position_embedding_size": 64}
    audio = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "output_proj_dims": 16}
    audio |= {"subsampling_conv_channels": [4, 4]}
    config = transformers.AutoConfig.for_model(
        "gemma4", text_config=text, vision_config=vision, audio_config=audio
    )
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    _randomize(hf)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        towers = {k.split(".")[1] for k in f.keys()}  # noqa: SIM118
    assert {"vision_tower", "audio_tower", "embed_vision", "embed_audio", "language_model"} <= towers
    model, _ = load_model(ModelSource("hf", tmp_path, "gemma4-mm"), torch.float32, torch.device("cpu"))
    assert model.config.architecture == "gemma4" and model.config.num_kv_shared_layers == 3
    ids = _prompt(7, 2 * WINDOW + 3)
    got = _llm(tmp_path, attention="cascade").generate([{"prompt_token_ids": ids}], GREEDY)
    assert got[0].outputs[0].token_ids == _hf_generate(hf, ids)


def test_gemma4_over_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """Tensor parallelism (gloo, 2 ranks): the global layers' one KV head replicated on both ranks,
    K as V, KV-shared layers and the per-layer input table split by vocabulary rows give the tokens
    of one process."""
    pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")
    tiny_checkpoint("gemma4_shared", tmp_path)
    prefix = _prompt(5, 2 * WINDOW)
    prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(3)]
    one = _llm(tmp_path).generate(prompts, GREEDY)
    with _llm(tmp_path, tensor_parallel_size=2) as tp:  # its process group ends with it
        two = tp.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


GEMMA4_TINY = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    **SIZES,
    "num_hidden_layers": 4,
    "sliding_window": WINDOW,
}
F, S = "full_attention", "sliding_attention"
BAD_GEMMA4 = [
    ({"enable_moe_block": True, "top_k_experts": 2}, "enable_moe_block=True needs num_experts >= 1"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' is not supported"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers=4: at least one of the num_hidden_layers=4"),
    (  # the shared sliding layer has no sliding layer before it to read
        {"layer_types": [F, F, S, F], "num_kv_shared_layers": 2},
        "layer 2 (sliding_attention) is KV-shared",
    ),
    (
        {"per_layer_config": {"1": {"intermediate_size": 64}}},
        "per_layer_config[1] sets ['intermediate_size']",
    ),
    ({"per_layer_config": {"3": {"num_key_value_heads": 4}}}, "per_layer_config[3]: num_key_value_heads=4"),
    (
        {"rope_parameters": {F: {"rope_type": "longrope", "factor": 2.0}}},
        "unsupported rope_scaling type 'longrope'",
    ),
    (
        {"rope_parameters": {F: {"rope_type": "yarn", "factor": 2.0}}},
        "YaRN needs original_max_position_embeddings",
    ),
]


@pytest.mark.parametrize(("change", "message"), BAD_GEMMA4)
def test_gemma4_configs_it_cannot_serve_are_refused_by_name(change, message, tmp_path: Path) -> None:
    """Gemma 4's bidirectional attention, an MoE block without experts and configs that contradict
    themselves are refused at load, naming the field."""
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict({**GEMMA4_TINY, **change})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GEMMA4_TINY, **change}))
    with pytest.raises(ValueError, match=r"config\.json: .*" + re.escape(message)):
        LLM(model=f"dummy:{path}", device="cpu", dtype="float32", progress=False)


def test_gemma4_configs_read_as_hf_resolves_them() -> None:
    """HF's defaults where a config.json is silent (global layers of 512 dims, the last layer global,
    per-layer inputs of 256, proportional RoPE at a quarter of the global heads), the older
    ``global_head_dim`` / ``num_global_key_value_heads`` fields (the KV heads only with K as V), and a
    config written back by ``to_hf_dict`` reading the same."""
    bare = ModelConfig.from_hf_dict({**GEMMA4_TINY, "layer_types": [S] * 4})
    assert bare.layer_types == [S, S, S, F]  # the last layer is global, as HF makes it
    assert [bare.layer_kv_shape(i) for i in range(4)] == [(2, 16)] * 3 + [(2, 512)]
    assert (bare.hidden_size_per_layer_input, bare.vocab_size_per_layer_input) == (256, 262_144)
    global_rope = bare.layer_spec(3).rope
    assert (global_rope.dim, global_rope.scaling_dict["partial_rotary_factor"]) == (512, 0.25)
    old = {**GEMMA4_TINY, "global_head_dim": 32, "num_global_key_value_heads": 1}
    assert ModelConfig.from_hf_dict(old).layer_kv_shape(3) == (2, 32)  # KV heads only with K as V
    k_eq_v = {**old, "attention_k_eq_v": True, "num_kv_shared_layers": 1, "layer_types": [S, F, S, F]}
    k_eq_v = ModelConfig.from_hf_dict(k_eq_v)
    assert [k_eq_v.layer_kv_shape(i) for i in (2, 3)] == [(2, 16), (1, 32)]
    assert k_eq_v.kv_source(3) == 1 and k_eq_v.layer_spec(3).shares_kv and k_eq_v.layer_spec(1).k_eq_v
    for config in (bare, k_eq_v):
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_a_gemma3_checkpoint_is_served_over_http(family) -> None:
    """`prefixserve serve` of a Gemma 3 directory: the OpenAI completions route answers greedy tokens
    equal to the offline API's, with the prompt's prefix served from the cache on a repeat."""
    name, directory, _ = family
    if name != "gemma3_text":
        pytest.skip("one family over HTTP is enough: the server runs the same engine")
    import httpx

    from prefixserve.config import EngineConfig
    from prefixserve.entrypoints.openai.server import ServerThread, build_app

    ids = _prompt(9, 2 * WINDOW + 5)
    config = EngineConfig(
        model=str(directory), device="cpu", dtype="float32", num_kv_blocks=160, block_size=8
    )
    body = {"model": directory.name, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ServerThread(build_app(config)) as srv:
        answers = [httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text[:300]
    offline = _llm(directory, attention="cascade").generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert answers[0].json()["choices"][0]["text"] == offline[0].outputs[0].text
    assert answers[1].json()["choices"][0]["text"] == offline[0].outputs[0].text
    cached = (answers[1].json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= len(ids) // 8 * 8 - 8  # the repeat's whole blocks, but the last row, from the cache


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3"])
def test_bf16_loads_match_the_fp32_loads_rounded_once(name: str, tmp_path: Path) -> None:
    """A checkpoint loads straight into the model's dtype: every weight equals the fp32 load's rounded
    once to bf16 (Gemma 3's (1 + w) norms folded in fp32 first), and a dummy model of the same
    config (whose norms are drawn, not folded) loads in bf16 and generates."""
    tiny_checkpoint(name, tmp_path)
    wide, narrow = (_llm(tmp_path, dtype=d).engine.model for d in ("float32", "bfloat16"))
    narrow_params = dict(narrow.named_parameters())
    for pname, p in wide.named_parameters():
        assert torch.equal(narrow_params[pname], p.to(torch.bfloat16)), pname
    dummy = LLM(model=f"dummy:{tmp_path / 'config.json'}", dtype="bfloat16", device="cpu", progress=False)
    assert {p.dtype for p in dummy.engine.model.parameters()} == {torch.bfloat16}
    out = dummy.generate([{"prompt_token_ids": _prompt(5, 12)}], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3
