"""Mixture-of-experts families against HF transformers (issue 102): tiny random Qwen3-MoE, Mixtral and
gpt-oss checkpoints (more experts than are active; Qwen3-MoE with a dense layer among its MoE layers;
Mixtral and gpt-oss with windows shorter than the prompts, gpt-oss with sinks, biases and YaRN)
saved by ``save_pretrained`` load into prefixserve; last-token logits within 1e-4 of HF's in fp32,
32 greedy tokens equal to HF's ``generate``, and the same tokens (24 behind a shared prefix) with
shared-segment attention on and off and on a prefix-cache repeat, and over two ranks. The reference
MoE path is checked against HF's own experts block, ties included; gpt-oss's MXFP4 experts and a
Qwen3-MoE GGUF (F32 and Q8_0 experts) load as the checkpoint, damaged MXFP4 scales are refused by
name. BatchLLM's schedule and Prompt Cache modules give a plain engine's tokens; the shipped
real-shape configs count the published parameters; each rank holds half of every expert."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixserve import SamplingParams
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader import ModelSource, load_model
from prefixserve.model.moe_reference import experts_ref, route_ref
from tests.conftest import assert_pool_empty
from tests.test_model_families import SIZES, WINDOW, _hf_generate, _llm, _prompt, gguf_writer, prefill_logits

transformers = pytest.importorskip("transformers")

FAMILIES: dict[str, dict[str, Any]] = {
    # 7 experts, 3 active, renormalised; layer 1 keeps a dense MLP
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "num_experts": 7,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 40,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    # Qwen3-MoE's other rule: the k weights as the softmax gives them, experts every second layer
    "qwen3_moe_sparse_step": {
        "num_hidden_layers": 4,
        "num_experts": 5,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 36,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    },
    "mixtral": {
        "num_hidden_layers": 2,
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
    },
    # sliding and full layers alternating, sinks, biases everywhere, YaRN, the clamped SwiGLU
    "gpt_oss": {
        "num_hidden_layers": 3,
        "num_local_experts": 5,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,  # whole MXFP4 blocks of 32 (and hidden_size 96 below)
        "hidden_size": 96,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
            "truncate": False,
        },
    },
}
# Gemma 4's experts beside its dense MLP, sliding and global layers
FAMILIES["gemma4_moe"] = {
    "num_hidden_layers": 3,
    "enable_moe_block": True,
    "num_experts": 5,
    "top_k_experts": 2,
    "moe_intermediate_size": 24,
    "hidden_size_per_layer_input": 0,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "global_head_dim": 16,
}
ARCH = {"qwen3_moe_sparse_step": "qwen3_moe", "gemma4_moe": "gemma4_text"}


def tiny_checkpoint(name: str, directory: Path, **sizes: Any) -> Any:
    """A random HF model of ``name`` (``FAMILIES``' settings over ``SIZES``, then ``sizes``), norms,
    routers, biases and sinks drawn, saved into ``directory``; returns it (fp32, eval)."""
    config = transformers.AutoConfig.for_model(ARCH.get(name, name), **{**SIZES, **FAMILIES[name], **sizes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms of ones and a router of zeros would hide a misplaced weight
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + 1.0)
            elif pname.endswith("gate.weight") or "router" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif pname.endswith(("bias", "sinks")):  # zeros at init: a bias or sink dropped would hide
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif pname.endswith(("router.scale", "per_expert_scale")):  # ones at init
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    name = request.param
    if name.startswith("gemma4"):
        pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")
    directory = tmp_path_factory.mktemp(name)
    return name, directory, tiny_checkpoint(name, directory)


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)  # as HF's min_new_tokens: EOS masked
# behind a prefix of 2 windows and own parts of 3-13 tokens: every row's last decode steps have windows
# that start past the prefix
SHARED_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)


def test_config_reads_the_experts(family) -> None:
    name, directory, hf = family
    config = ModelConfig.from_json(directory / "config.json")
    moe = [config.layer_spec(i).moe for i in range(config.num_hidden_layers)]
    if name == "qwen3_moe":
        assert moe == [True, False, True] and config.norm_topk_prob and config.qk_norm
    elif name == "qwen3_moe_sparse_step":
        assert moe == [False, True, False, True] and not config.norm_topk_prob
    elif name == "gemma4_moe":
        assert not any(moe) and config.moe_beside_mlp and config.num_experts_per_tok == 2
    elif name == "gpt_oss":
        assert all(moe) and config.attention_sinks and config.router_rule == "topk_softmax"
        assert config.layer_spec(0).window == WINDOW and config.layer_spec(1).window is None
        assert config.layer_spec(0).rope.scaling_dict["rope_type"] == "yarn"
    else:
        assert all(moe) and config.norm_topk_prob and config.has_sliding_layers
    hf_k = getattr(hf.config, "num_experts_per_tok", None) or hf.config.top_k_experts  # Gemma 4's name
    assert config.num_experts_per_tok == hf_k
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_logits_match_hf(family) -> None:
    name, directory, hf = family
    model, _ = load_model(ModelSource("hf", directory, name), torch.float32, torch.device("cpu"))
    for length in (9, 2 * WINDOW + 5):
        ids = _prompt(length, length)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1:]
        torch.testing.assert_close(prefill_logits(model, ids)[-1:], ref, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_hf_generate_and_sharing_changes_none(family) -> None:
    """HF's greedy tokens; then 6 prompts behind a prefix of two windows: shared-segment attention and
    the prefix cache on, off and on a repeat, all the same tokens."""
    _, directory, hf = family
    prompts = [_prompt(1, 10), _prompt(2, 2 * WINDOW + 3)]
    llm = _llm(directory, attention="cascade")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_generate(hf, p) for p in prompts]
    prefix = _prompt(5, 2 * WINDOW)
    shared_prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(6)]
    plain = _llm(directory, attention="reference", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(shared_prompts, SHARED_GREEDY)]
    first = llm.generate(shared_prompts, SHARED_GREEDY)
    again = llm.generate(shared_prompts, SHARED_GREEDY)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    metrics = llm.metrics()
    assert metrics["attention_kv_tokens_read_total"] < metrics["attention_kv_tokens_logical_total"]
    assert metrics["prefix_cache_hit_tokens_total"] > 0
    assert_pool_empty(llm)
    assert_pool_empty(plain)


PML_SCHEMA = """<schema name="facts">You answer from the facts below.
<module name="alpha">Alpha is the first letter of the Greek alphabet; it is used a lot.</module>
<module name="beta">Beta is the second letter; it comes after alpha and before gamma.</module>
</schema>"""
PML_PROMPTS = [
    '<prompt schema="facts"><alpha/><beta/> Which is first?</prompt>',
    '<prompt schema="facts"><beta/> Say it.</prompt>',
]
SHORT_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_batch_schedule_and_prompt_cache_give_the_reference_tokens(family) -> None:
    """BatchLLM's offline schedule over prompts behind a shared prefix, and PML prompts reading a
    schema's modules (every layer's KV kept: modules need one shape), give a plain engine's tokens."""
    _, directory, _ = family
    plain = _llm(
        directory,
        attention="reference",
        enable_prefix_caching=False,
        keep_sliding_kv=True,
        module_recompute="none",
    )
    prefix = _prompt(5, 2 * WINDOW)
    prompts = [{"prompt_token_ids": prefix + _prompt(20 + i, 3 + 2 * i)} for i in range(3)]
    batch = _llm(directory, attention="cascade")
    want = _tokens(plain.generate(prompts, SHORT_GREEDY))
    assert _tokens(batch.generate(prompts, SHORT_GREEDY, schedule="batch")) == want
    metrics = batch.metrics()
    assert metrics["attention_kv_tokens_read_total"] < metrics["attention_kv_tokens_logical_total"]
    cached = _llm(directory, attention="cascade", keep_sliding_kv=True, module_recompute="none")
    for llm in (plain, cached):
        llm.register_schema(PML_SCHEMA)
    want = _tokens(plain.generate(PML_PROMPTS, SHORT_GREEDY))
    assert _tokens(cached.generate(PML_PROMPTS, SHORT_GREEDY)) == want
    assert cached.metrics()["shared_segments_total"] > 0
    for llm in (plain, cached):
        llm.unregister_schema("facts")
    for llm in (plain, batch, cached):
        assert_pool_empty(llm)


def test_the_reference_experts_are_hfs(family) -> None:
    """``route_ref`` and ``experts_ref`` on a layer's weights give HF's MoE block's output, on random
    tokens and on tokens all routed alike (identical rows)."""
    name, directory, hf = family
    model, _ = load_model(ModelSource("hf", directory, name), torch.float32, torch.device("cpu"))
    if name == "gemma4_moe":  # the experts beside the MLP: router and experts on the stream
        mine, theirs = model.model.layers[0], hf.model.layers[0]

        def ours(x: torch.Tensor) -> torch.Tensor:
            return mine.experts(mine.pre_feedforward_layernorm_2(x), *mine.router(x))

        def block(x: torch.Tensor) -> torch.Tensor:
            _, weights, ids = theirs.router(x[0])
            return theirs.experts(theirs.pre_feedforward_layernorm_2(x[0]), ids, weights)[None]

    else:
        layer = next(i for i in range(len(model.model.layers)) if model.full_config.layer_spec(i).moe)
        ours = model.model.layers[layer].mlp
        block = hf.model.layers[layer].mlp if hasattr(hf.model.layers[layer], "mlp") else None
        block = block if block is not None else hf.model.layers[layer].block_sparse_moe
    gen = torch.Generator().manual_seed(3)
    width = hf.config.hidden_size
    for x in (torch.randn(13, width, generator=gen), torch.randn(1, width, generator=gen).expand(5, -1)):
        with torch.no_grad():
            want = block(x[None])
            want = want[0] if isinstance(want, tuple) else want
            got = ours(x.contiguous())
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def test_routing_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    weights, ids = route_ref(logits, 2, "softmax_topk", norm=True)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))
    weights, ids = route_ref(logits, 3, "topk_softmax")
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_experts_that_get_no_token_and_one_expert_for_all() -> None:
    """The reference against a dense per-token computation: every token on expert 2 (the others get
    none), and tokens spread over a few."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 5, 16, 12, 7
    w_up = torch.randn(experts * 2 * inter, hidden, generator=gen)
    w_down = torch.randn(experts * hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    for ids in (torch.full((tokens, 2), 2), torch.randint(0, 3, (tokens, 2), generator=gen)):
        weights = torch.rand(tokens, 2, generator=gen)
        got = experts_ref(x, w_up, w_down, weights, ids)
        want = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for j in range(2):
                e = int(ids[t, j])
                gu = w_up.view(experts, 2 * inter, hidden)[e] @ x[t]
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                want[t] += weights[t, j] * (w_down.view(experts, hidden, inter)[e] @ act)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


BASE = {"architectures": ["Qwen3MoeForCausalLM"], **SIZES, "num_hidden_layers": 2, "moe_intermediate_size": 8}
BAD_MOE = [
    ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5 must be in 1..num_experts=4"),
    (
        {"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [3]},
        "mlp_only_layers names layers [3]",
    ),
    ({"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"num_experts_per_tok": 2}, "needs num_experts"),
    (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": None},
        "needs moe_intermediate_size",
    ),
]


@pytest.mark.parametrize(("change", "message"), BAD_MOE)
def test_moe_configs_that_contradict_themselves_are_refused(change, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict({**BASE, **change})


@pytest.mark.parametrize("written", ["window", "nothing"])
def test_a_gpt_oss_config_without_layer_types_alternates_as_hfs(written: str, tmp_path: Path) -> None:
    """``GptOssConfig`` fills in alternating layers, sliding first, and a window of 128 when the file
    names none: a config.json without them reads the same, and (with the window written) gives HF's
    logits past the window."""
    hf = tiny_checkpoint("gpt_oss", tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    del raw["layer_types"]
    if written == "nothing":
        del raw["sliding_window"]
    path.write_text(json.dumps(raw))
    config = ModelConfig.from_json(path)
    window = WINDOW if written == "window" else 128
    assert [config.layer_spec(i).window for i in range(3)] == [window, None, window]
    if written == "window":
        model, _ = load_model(ModelSource("hf", tmp_path, "gpt_oss"), torch.float32, torch.device("cpu"))
        ids = _prompt(7, 2 * WINDOW + 5)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1:]
        torch.testing.assert_close(prefill_logits(model, ids)[-1:], ref, rtol=1e-4, atol=1e-4)


# shipped dummy config: experts, active, router rule, renormalised, parameters as published
REAL_SIZES = {
    "qwen3-30b-a3b": (128, 8, "softmax_topk", True, 30.53e9),
    "gpt-oss-20b": (32, 4, "topk_softmax", False, 20.91e9),
    "mixtral-8x7b": (8, 2, "softmax_topk", True, 46.70e9),
}
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("name", list(REAL_SIZES))
def test_the_shipped_moe_configs_are_the_published_models(name: str) -> None:
    """``dummy:NAME`` at real shapes: its experts and router, gpt-oss's alternating window of 128
    and YaRN, and the parameters of the model built from it (meta device) within 1% of the count
    published."""
    from prefixserve.model.llama import LlamaForCausalLM
    from prefixserve.model.loader import resolve_model
    from prefixserve.model.parallel import Shard

    experts, active, rule, norm, published = REAL_SIZES[name]
    source = resolve_model(f"dummy:{name}")
    config = ModelConfig.from_json(source.path)
    assert source.kind == "dummy" and config.num_experts == experts
    assert (config.num_experts_per_tok, config.router_rule, config.norm_topk_prob) == (active, rule, norm)
    if name == "gpt-oss-20b":
        specs = [config.layer_spec(i) for i in range(config.num_hidden_layers)]
        assert [spec.window for spec in specs] == [128, None] * (config.num_hidden_layers // 2)
        assert all(spec.rope.scaling_dict.items() >= GPT_OSS_YARN.items() for spec in specs)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, Shard())
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - published) < 0.01 * published, f"{count / 1e9:.2f}B parameters"


def _e2m1(code: int) -> float:
    """An E2M1 code's value from the format's definition: sign, two exponent bits (bias 1), one
    mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)


def test_mxfp4_dequantizes_by_the_format_definition() -> None:
    from prefixserve.model import mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 4, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 135, (3, 4, 2), generator=gen, dtype=torch.uint8)
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == (3, 4, 64)
    for idx in [(0, 0), (2, 3), (1, 2)]:
        for g in range(2):
            for j in range(32):
                byte = int(blocks[idx][g, j // 2])
                code = byte & 0x0F if j % 2 == 0 else byte >> 4  # the low nibble first
                want = _e2m1(code) * 2.0 ** (int(scales[idx][g]) - 127)
                assert float(got[idx][g * 32 + j]) == want
    assert mxfp4.checkpoint_tensor(blocks, scales).shape == (3, 64, 4)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, scales[..., :1])
    scales[1, 2, 0] = 0xFF  # E8M0's NaN: that block's 32 values, no other
    got = mxfp4.dequantize(blocks, scales)
    assert got[1, 2, :32].isnan().all() and int(got.isnan().sum()) == 32
    pairs = mxfp4.Pairs()  # as the loader meets them: refused, the tensor named
    assert pairs.add("layers.0.experts.down_proj_blocks", blocks) is None
    refusal = re.escape("layers.0.experts.down_proj_scales holds scale 0xFF (NaN in the MX format)")
    with pytest.raises(ValueError, match=refusal):
        pairs.add("layers.0.experts.down_proj_scales", scales)


def _mxfp4_checkpoint(directory: Path) -> Any:
    """A tiny gpt-oss saved as published: each layer's experts as MXFP4 blocks and scales; returns the
    HF model holding the same (dequantized) weights."""
    from safetensors.torch import load_file, save_file

    from prefixserve.model import mxfp4

    hf = tiny_checkpoint("gpt_oss", directory)
    cfg = hf.config
    gen = torch.Generator().manual_seed(4)
    state = load_file(str(directory / "model.safetensors"))
    e, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
                pad = -(-cols // 32) * 32  # the packed width: whole blocks of 32
                blocks = torch.randint(0, 256, (e, rows, pad // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(122, 128, (e, rows, pad // 32), generator=gen, dtype=torch.uint8)
                if pad != cols:
                    pytest.skip("the tiny sizes must be whole MXFP4 blocks")
                values = mxfp4.checkpoint_tensor(blocks, scales)  # [E, cols, rows]: HF's layout
                getattr(layer.mlp.experts, proj).copy_(values)
                name = f"model.layers.{i}.mlp.experts.{proj}"
                del state[name]
                state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, str(directory / "model.safetensors"))
    return hf


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads(tmp_path: Path) -> None:
    """gpt-oss as published: each layer's experts as MXFP4 blocks and scales. The model loads them
    dequantized and gives HF's logits for the same (dequantized) weights."""
    hf = _mxfp4_checkpoint(tmp_path)
    model, _ = load_model(ModelSource("hf", tmp_path, "gpt-oss-mxfp4"), torch.float32, torch.device("cpu"))
    ids = _prompt(3, 40)
    logits = prefill_logits(model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_a_missing_expert_is_named_as_the_checkpoint_names_it(tmp_path: Path) -> None:
    """One expert's up projection left out: the error names that tensor, not the stacked parameter
    it fills."""
    from safetensors.torch import load_file, save_file

    tiny_checkpoint("qwen3_moe", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=re.escape("missing weights ['model.layers.0.mlp.experts.3.up_proj.weight']")
    ):
        load_model(ModelSource("hf", tmp_path, "qwen3_moe"), torch.float32, torch.device("cpu"))


def test_mxfp4_scales_of_the_wrong_shape_are_refused_by_name(tmp_path: Path) -> None:
    """One group too many in one ``_scales`` tensor: a ValueError naming it and both shapes, not a
    reshape's error."""
    from safetensors.torch import load_file, save_file

    _mxfp4_checkpoint(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    name = "model.layers.1.mlp.experts.down_proj"
    blocks, scales = state[f"{name}_blocks"], state[f"{name}_scales"]
    state[f"{name}_scales"] = wrong = torch.cat([scales, scales[..., :1]], dim=-1)
    save_file(state, str(file))
    with pytest.raises(ValueError, match=re.escape(f"{name}_scales {tuple(wrong.shape)}")) as refused:
        load_model(ModelSource("hf", tmp_path, "gpt-oss-mxfp4"), torch.float32, torch.device("cpu"))
    assert str(tuple(blocks.shape)) in str(refused.value)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "gemma4_moe"])
def test_experts_over_two_ranks_equal_one_process(name: str, tmp_path: Path) -> None:
    """Tensor parallelism (gloo, 2 ranks): every expert's intermediate columns split over the ranks
    (gpt-oss: its stacked tensors converted per rank, the down bias added once, sinks split by head)
    gives the tokens of one process."""
    tiny_checkpoint(name, tmp_path)
    prefix = _prompt(5, 2 * WINDOW)
    prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(3)]
    one = _llm(tmp_path).generate(prompts, GREEDY)
    with _llm(tmp_path, tensor_parallel_size=2) as tp:  # its process group ends with it
        two = tp.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_each_rank_holds_its_half_of_every_experts_columns(family) -> None:
    """Two ranks without their processes (meta device): each holds I / 2 columns of every expert, its
    own half; a moe_intermediate_size the ranks do not divide is refused, named."""
    from dataclasses import replace

    from prefixserve.model.llama import LlamaForCausalLM
    from prefixserve.model.moe import Experts
    from prefixserve.model.parallel import Shard, check_divisible

    _, directory, _ = family
    config = ModelConfig.from_json(directory / "config.json")
    inter, hidden, count = config.moe_intermediate_size, config.hidden_size, config.num_experts
    half = inter // 2
    for rank in (0, 1):
        assert Shard(rank, 2).local_config(config).moe_intermediate_size == half
        with torch.device("meta"):
            model = LlamaForCausalLM(config, Shard(rank, 2))
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        assert experts and all(m.cols == (rank * half, (rank + 1) * half) for m in experts)
        assert all(m.w_up.shape == (count * 2 * half, hidden) for m in experts)
        assert all(m.w_down.shape == (count * hidden, half) for m in experts)
    odd = replace(config, moe_intermediate_size=inter + 1)
    with pytest.raises(ValueError, match=re.escape(f"divide the model's moe_intermediate_size={inter + 1}")):
        check_divisible(odd, 2)


def _llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for a Llama (its converter's permute: each head's rotate-half pairs
    interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
GGUF_NAMES |= {
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "mlp.gate": "ffn_gate_inp",
}
GGUF_NAMES |= {
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_NAMES |= {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
Q8_0_SIZES = {"hidden_size": 96, "moe_intermediate_size": 64}  # experts' rows of whole Q8_0 blocks (32)


def _write_stacked_experts(
    writer: Any, by_expert: dict[str, list[tuple[int, str, torch.Tensor]]], quant: str
) -> dict[str, torch.Tensor]:
    """Each layer's experts stacked, as llama.cpp writes them, in ``quant`` (F32 or Q8_0); returns
    each expert's values as a reader must give them back: ``gguf``'s own dequantization of the bytes."""
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType[quant]
    given_back: dict[str, torch.Tensor] = {}
    for gguf_name, per_expert in by_expert.items():
        ordered = sorted(per_expert, key=lambda p: p[0])
        stacked = torch.stack([t for _, _, t in ordered]).float().numpy()
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, stacked)
            continue
        packed = gguf.quants.quantize(stacked, kind)
        writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=kind)
        values = torch.from_numpy(gguf.quants.dequantize(packed, kind).reshape(stacked.shape))
        given_back |= {key: values[i] for i, (_, key, _) in enumerate(ordered)}
    return given_back


@pytest.mark.parametrize(
    ("name", "arch", "stacked", "quant"),
    [
        ("qwen3_moe", "qwen3moe", True, "F32"),
        ("mixtral", "llama", True, "F32"),
        ("mixtral", "llama", False, "F32"),
        ("qwen3_moe", "qwen3moe", True, "Q8_0"),
    ],
)
def test_an_moe_gguf_reads_as_the_checkpoint(
    name: str, arch: str, stacked: bool, quant: str, tmp_path: Path
) -> None:
    """An MoE GGUF as llama.cpp writes it (each layer's experts stacked, the router as
    ``ffn_gate_inp``; Qwen3-MoE with a layer without experts, Mixtral as a Llama with experts, its q
    and k rows permuted; and as it wrote Mixtral before it stacked them, ``blk.L.ffn_gate.E``) reads
    into the HF checkpoint's weights and config, and the model built from it gives HF's logits
    (prompts inside Mixtral's window: a GGUF names none). Experts in Q8_0: the reader gives gguf's
    dequantized values exactly."""
    from prefixserve.model.families.moe import mixtral_name

    hf = tiny_checkpoint(name, tmp_path / "hf", **(Q8_0_SIZES if quant == "Q8_0" else {}))
    cfg = hf.config
    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf_writer(cfg, path, arch)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if name == "qwen3_moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    from safetensors.torch import load_file

    state = {mixtral_name(k): v for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}
    by_expert: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if parts[1] != "layers":
            top = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }
            writer.add_tensor(top.get(key, "output.weight"), tensor.float().numpy())
        elif parts[4] == "experts" and not stacked:  # one tensor an expert: blk.L.ffn_gate.E.weight
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES['mlp.' + parts[6]]}.{parts[5]}.weight"
            writer.add_tensor(gguf_name, tensor.float().numpy())
        elif parts[4] == "experts":  # model.layers.L.mlp.experts.E.gate_proj.weight
            by_expert.setdefault(f"blk.{parts[2]}.{GGUF_EXPERTS[parts[6]]}.weight", []).append(
                (int(parts[5]), key, tensor)
            )
        else:
            module = ".".join(parts[3:-1])
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
                tensor = _llama_permute(tensor, heads)
            writer.add_tensor(f"blk.{parts[2]}.{GGUF_NAMES[module]}.{parts[-1]}", tensor.float().numpy())
    state |= _write_stacked_experts(writer, by_expert, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from prefixserve.model.gguf_reader import iter_gguf_weights, load_gguf

    reader, config = load_gguf(path)
    dense = [1] if name == "qwen3_moe" else []
    assert (config.architecture, config.num_experts, config.mlp_only_layers) == (name, experts, dense)
    weights = dict(iter_gguf_weights(reader, config))
    assert set(weights) == set(state)
    for key, tensor in state.items():
        assert torch.equal(weights[key], tensor.float()), key
    if quant != "F32":  # its logits are Q8_0's, not HF's
        assert {t.tensor_type.name for t in reader.tensors if "_exps" in t.name} == {quant}
        return
    from safetensors.torch import save_file  # what the conversion cache holds (``loader.convert_gguf``)

    converted = tmp_path / "converted"
    converted.mkdir()
    save_file(weights, str(converted / "model.safetensors"))
    (converted / "config.json").write_text(json.dumps(config.to_hf_dict()))
    model, _ = load_model(ModelSource("hf", converted, "tiny"), torch.float32, torch.device("cpu"))
    ids = _prompt(3, 20)
    logits = prefill_logits(model, ids, "reference")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def _dummy_moe(tmp_path: Path, layers: int) -> Any:
    """A dummy (random-weight) Qwen3-MoE model of ``layers`` layers, 64 experts, 4 active, on the CPU."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 300}
    config |= {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16}
    config |= {
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
    }
    config |= {"num_experts": 64, "num_experts_per_tok": 4, "norm_topk_prob": True}
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    model, _ = load_model(
        ModelSource("dummy", path, "dummy-moe"), torch.float32, torch.device("cpu"), progress=False
    )
    return model


def test_dummy_routing_reads_draws_made_at_load(tmp_path: Path) -> None:
    """A dummy model's routers read their draws from one table made at load (views: a decode step
    runs no draw kernel): each layer its own rows, the same rows each call, the router product's
    split-K partials shaped as given; a step larger than the table draws afresh."""
    from prefixserve.model import dummy_routing
    from prefixserve.model.moe import MoE

    model = _dummy_moe(tmp_path, layers=3)
    first, second = [m for m in model.modules() if isinstance(m, MoE)][:2]
    logits = torch.zeros(5, 64)
    a, b = first.simulate(logits), second.simulate(logits)
    assert a.shape == logits.shape and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert not torch.equal(a, b) and torch.equal(a, first.simulate(logits))
    assert torch.equal(a[1:], b[:-1])  # layer i reads rows i .. i + T of one table
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    parts = first.simulate(torch.zeros(8, 2, 64))
    assert parts.shape == (8, 2, 64) and parts.dtype == torch.float32
    big = torch.zeros(dummy_routing.TABLE_ROWS + 1, 64)
    fresh = first.simulate(big)
    assert fresh.shape == big.shape and fresh.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def test_uniform_routing_is_for_dummy_weights_only(tmp_path: Path) -> None:
    """A dummy MoE model's routers draw each row's logits at random, so 16 equal rows spread over the
    experts as a balanced router's would; a checkpoint routes by its weights (the 16 equal rows all go
    to the same k experts)."""
    from prefixserve.model import fused
    from prefixserve.model.moe import MoE

    dummy = _dummy_moe(tmp_path, layers=1)

    def touched(model: Any) -> int:
        mlp = model.model.layers[0].mlp
        rows = torch.randn(1, mlp.gate.weight.shape[1]).expand(16, -1).contiguous()
        _, ids = fused.moe_route(mlp.simulate(mlp.gate(rows)), mlp.top_k, mlp.rule, mlp.norm)
        return int(torch.unique(ids).numel())

    assert touched(dummy) > 24  # 16 rows x 4 of 64 experts at random: 40 expected
    tiny_checkpoint("qwen3_moe", tmp_path / "hf")
    hf_model, _ = load_model(ModelSource("hf", tmp_path / "hf", "tiny"), torch.float32, torch.device("cpu"))
    assert all(m.simulate is MoE.simulate for m in hf_model.modules() if isinstance(m, MoE))
    assert touched(hf_model) == hf_model.model.layers[0].mlp.top_k


def test_experts_stored_as_one_stacked_tensor_load_as_the_per_expert_ones(tmp_path: Path) -> None:
    """Published Qwen3.5-MoE checkpoints (and transformers 5's own experts) hold a layer's experts as
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and ``down_proj`` [E, H, I]; the same
    model saved either way gives HF's logits."""
    from safetensors.torch import load_file, save_file

    from tests.test_model_families import assert_logits_match_hf

    hf = tiny_checkpoint("qwen3_moe", tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    weights = load_file(str(file))
    experts = FAMILIES["qwen3_moe"]["num_experts"]
    for layer in (0, 2):  # layer 1 keeps a dense MLP
        p = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([weights.pop(f"{p}.{e}.gate_proj.weight") for e in range(experts)])
        up = torch.stack([weights.pop(f"{p}.{e}.up_proj.weight") for e in range(experts)])
        weights[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        weights[f"{p}.down_proj"] = torch.stack(
            [weights.pop(f"{p}.{e}.down_proj.weight") for e in range(experts)]
        ).contiguous()
    save_file(weights, str(file), metadata={"format": "pt"})
    assert_logits_match_hf(("stacked", tmp_path, hf), (9,))


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_mxfp4_checkpoint_tensors_dequantize_an_expert_at_a_time_as_whole(lead: tuple[int, ...]) -> None:
    """``mxfp4.checkpoint_tensor`` works an expert at a time (host memory): the same values and layout
    as the whole tensor dequantized and its last two dims swapped."""
    from prefixserve.model import mxfp4

    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (*lead, 5, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (*lead, 5, 4), dtype=torch.uint8, generator=gen)
    got = mxfp4.checkpoint_tensor(blocks, scales)
    assert got.is_contiguous()
    assert torch.equal(got, mxfp4.dequantize(blocks, scales).transpose(-2, -1))
