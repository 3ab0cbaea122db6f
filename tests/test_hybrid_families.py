"""Linear-attention hybrids against HF transformers (issue 107): tiny random Qwen3.5 (dense and MoE)
and Qwen3-Next checkpoints (Gated DeltaNet layers between gated, partially rotated full-attention
layers; Qwen3-Next with a dense layer among its MoE layers, both MoEs with a shared expert) written by
their config classes load into prefixserve; last-token logits within 1e-4 of HF's in fp32, 32 greedy
tokens equal to HF's ``generate`` through the engine with chunked prefill; the same tokens with
shared-segment attention on and off, on prefix-cache hits (resumed from the linear layers' state
snapshots), after preemption, and for every sample of n > 1 (the parent's states copied)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader import ModelSource, load_model
from tests.conftest import assert_pool_empty
from tests.test_model_families import SIZES, _hf_generate, _llm, _prompt, _randomize, prefill_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5", reason="this transformers has no Qwen3.5")

LINEAR = {  # Gated DeltaNet sizes: 2 key heads serving 4 value heads
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 10,
    "linear_conv_kernel_dim": 4,
}
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
EXPERTS = {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {"num_hidden_layers": 5, "layer_types": LAYERS},
    "qwen3_5_moe_text": {"num_hidden_layers": 4, **EXPERTS, "shared_expert_intermediate_size": 20},
    "qwen3_next": {
        "num_hidden_layers": 4,
        **EXPERTS,
        "shared_expert_intermediate_size": 20,
        "mlp_only_layers": [1],
        "norm_topk_prob": False,
    },
}
# shorter than the default (0.25 of 16 = 4 dims): half of each head turns
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}


def tiny_checkpoint(name: str, directory: Path) -> Any:
    config = transformers.AutoConfig.for_model(name, **{**SIZES, **LINEAR, **ROPE, **FAMILIES[name]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(model)  # (1 + w) norms and the gated norm's w alike: around 1 (0.3 spread)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("gate.weight", "dt_bias")):  # routers (zeros at init), the decay's bias
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, tiny_checkpoint(request.param, directory)


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)  # as HF's min_new_tokens: EOS masked


def test_config_reads_the_layers(family) -> None:
    name, directory, hf = family
    config = ModelConfig.from_json(directory / "config.json")
    assert config.layer_types == list(hf.config.layer_types) and config.is_hybrid
    assert config.linear_layers == [i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"]
    assert config.rope_scaling == {"rope_type": "partial", "partial_rotary_factor": 0.5}
    assert config.attn_output_gate and config.norm_weight_offset == 1.0
    full = [i for i in range(config.num_hidden_layers) if i not in config.linear_layers]
    assert config.kv_bytes_per_token == 2 * len(full) * config.num_key_value_heads * config.head_dim
    if name != "qwen3_5_text":
        assert config.shared_expert_intermediate_size == 20
        moe = [config.is_moe_layer(i) for i in range(config.num_hidden_layers)]
        assert moe == ([True, False, True, True] if name == "qwen3_next" else [True] * 4)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_logits_match_hf(family) -> None:
    from tests.test_model_families import assert_logits_match_hf

    assert_logits_match_hf(family, (9, 75))  # one chunk of the rule (64), and two


def test_greedy_tokens_equal_hf_generate_in_chunks(family) -> None:
    """HF's 32 greedy tokens, the prompts prefilled in chunks of 16 tokens (the states carried over)."""
    _, directory, hf = family
    prompts = [_prompt(1, 10), _prompt(2, 53)]
    llm = _llm(directory, attention="cascade", max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_generate(hf, p) for p in prompts]
    assert_pool_empty(llm)
    assert llm.engine.blocks.states.num_held == 0


@pytest.fixture(scope="module")
def next_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Next alone (experts, a dense layer, a shared expert) for the engine's longer runs."""
    directory = tmp_path_factory.mktemp("qwen3_next_engine")
    tiny_checkpoint("qwen3_next", directory)
    return directory


def test_sharing_repeats_preemption_and_samples_change_no_token(next_model: Path) -> None:
    """4 prompts behind one prefix of 70 tokens: the cascade backend with prefix caching (the prefix's
    linear states snapshotted at token 64, its hits cut back there and resumed from the snapshot) and
    the reference without, a repeat, an offline batch (one prefix-sharing group), a pool so small that
    sequences are preempted and recomputed; n=3 greedy samples each equal to the one greedy sequence
    (each sample's states copied from the prompt's), seeded samples as the reference's."""
    directory = next_model
    prefix = _prompt(5, 70)
    prompts = [{"prompt_token_ids": prefix + _prompt(10 + i, 3 + 2 * i)} for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = _llm(directory, attention="reference", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    shared = _llm(directory, attention="cascade", max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in shared.generate(prompts, greedy)] == want
    first = shared.metrics()["prefix_cache_hit_tokens_total"]
    assert first == 3 * 64  # the prompts after the first resume at the snapshot (64 of 70 tokens)
    assert [o.outputs[0].token_ids for o in shared.generate(prompts, greedy)] == want
    metrics = shared.metrics()
    assert metrics["prefix_cache_hit_tokens_total"] - first == 4 * 64  # a repeat: all from the snapshot
    assert metrics["attention_kv_tokens_read_total"] < metrics["attention_kv_tokens_logical_total"]
    batch = shared.generate(prompts, greedy, schedule="batch")  # one group: its prefix computed once
    assert [o.outputs[0].token_ids for o in batch] == want
    small = _llm(directory, num_kv_blocks=20)  # 4 x 12 blocks at the end: preempted on the way
    assert [o.outputs[0].token_ids for o in small.generate(prompts, greedy)] == want
    assert small.engine.scheduler.num_preemptions > 0
    group = SamplingParams(temperature=0.0, n=3, max_tokens=16, ignore_eos=True)
    outs = shared.generate(prompts[:2], group)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w] * 3 for w in want[:2]]
    seeded = SamplingParams(temperature=0.8, n=3, seed=3, max_tokens=12, ignore_eos=True)
    samples = [[c.token_ids for c in o.outputs] for o in shared.generate(prompts[:2], seeded)]
    assert samples == [[c.token_ids for c in o.outputs] for o in plain.generate(prompts[:2], seeded)]
    for llm in (plain, shared, small):
        assert_pool_empty(llm)
        assert llm.engine.blocks.states.num_held == 0


def test_a_hit_past_the_last_snapshot_resumes_from_it(next_model: Path) -> None:
    """Snapshots every 64 tokens; a prompt whose cached blocks reach 120 tokens resumes at 64 when
    the snapshot at 128 is not there, and at 128 once a longer prompt took it; tokens as computed whole."""
    long = _prompt(7, 150)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = _llm(next_model, enable_prefix_caching=False)
    llm = _llm(next_model)
    for prompt in (long[:121], long[:125], long):
        want = plain.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
        before = llm.metrics()["prefix_cache_hit_tokens_total"]
        assert llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids == want
        hit = llm.metrics()["prefix_cache_hit_tokens_total"] - before
        assert hit == {121: 0, 125: 64, 150: 64}[len(prompt)]
    before = llm.metrics()["prefix_cache_hit_tokens_total"]
    again = llm.generate([{"prompt_token_ids": long[:140]}], greedy)[0].outputs[0].token_ids
    assert llm.metrics()["prefix_cache_hit_tokens_total"] - before == 128
    assert again == plain.generate([{"prompt_token_ids": long[:140]}], greedy)[0].outputs[0].token_ids
    assert_pool_empty(llm)


# 70 tokens: each later turn's hit boundary (64, then 128) still falls inside the reply before it (the
# 40-token prompt's reply spans 40-110, the next 120-190); 100 decoded 30% more of the same steps
CHAT_REPLY = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
Replies = Callable[[list[int]], list[int]]  # a chat's prompt ids -> the plain engine's reply


@pytest.fixture(scope="module")
def chat_replies(next_model: Path) -> Replies:
    """The plain engine's (no prefix cache, no launch-ahead) reply to a chat (``CHAT_REPLY``), each
    made once for the module: both chat tests take the same turns."""
    plain = _llm(next_model, enable_prefix_caching=False, async_scheduling=False)
    replies: dict[tuple[int, ...], list[int]] = {}

    def reply(chat: list[int]) -> list[int]:
        if tuple(chat) not in replies:
            replies[tuple(chat)] = (
                plain.generate([{"prompt_token_ids": chat}], CHAT_REPLY)[0].outputs[0].token_ids
            )
        return replies[tuple(chat)]

    return reply


def test_a_chats_next_turn_resumes_after_the_reply(next_model: Path, chat_replies: Replies) -> None:
    """Decode steps snapshot too (on the batched path): a chat's next turn (its prompt, the reply,
    a new message) resumes at the reply's last 64-token boundary, as a full-attention model's cache
    would hit up to its last block, and its tokens are as computed whole."""
    llm = _llm(next_model)
    _chat_turns(chat_replies, llm)
    assert_pool_empty(llm)


def _chat_turns(plain_reply: Replies, llm: LLM) -> None:
    """Three turns of one chat (a 70-token reply, then 10 new tokens): ``llm``'s tokens equal the
    plain engine's (``chat_replies``), and each later turn hits up to the last reply's 64-token
    boundary."""
    chat = _prompt(11, 40)
    for turn in range(3):
        want = plain_reply(chat)
        before = llm.metrics()["prefix_cache_hit_tokens_total"]
        got = llm.generate([{"prompt_token_ids": chat}], CHAT_REPLY)[0].outputs[0].token_ids
        assert got == want
        hit = llm.metrics()["prefix_cache_hit_tokens_total"] - before
        assert hit == (0 if turn == 0 else (len(chat) - 10 - 1) // 64 * 64)  # the last reply's boundary
        chat = chat + got + _prompt(20 + turn, 10)


def test_snapshots_spill_to_host_memory_and_come_back(next_model: Path) -> None:
    """With the prefix cache's host tier on and a pool and snapshot slots too small to keep a
    prompt's blocks and snapshots, both go to host memory as other prompts evict them; the prompt's
    repeat resumes from there (its KV blocks and the snapshot at token 128 restored) with the tokens
    computed whole; a prefix-cache reset drops the host snapshots too."""
    long = _prompt(7, 150)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _llm(next_model, enable_prefix_caching=False).generate({"prompt_token_ids": long}, greedy)
    llm = _llm(next_model, spill_prefix_cache=True, max_num_seqs=1, num_kv_blocks=24)
    assert (
        llm.generate({"prompt_token_ids": long}, greedy)[0].outputs[0].token_ids
        == want[0].outputs[0].token_ids
    )
    for seed in (8, 9, 10):  # each takes 20 of the 24 blocks and both snapshot slots
        llm.generate({"prompt_token_ids": _prompt(seed, 150)}, greedy)
    spill = llm.engine.blocks.states.spill
    assert spill is not None and spill.spilled >= 2
    before = llm.metrics()["prefix_cache_hit_tokens_total"]
    again = llm.generate({"prompt_token_ids": long}, greedy)[0].outputs[0].token_ids
    assert again == want[0].outputs[0].token_ids
    assert llm.metrics()["prefix_cache_hit_tokens_total"] - before == 128
    assert spill.restored == 1 and llm.engine.blocks.restored_tokens >= 128
    assert_pool_empty(llm)
    assert llm.engine.reset_prefix_cache() and len(spill._held) == 0


TINY_HYBRID = {  # dummy weights, SmolLM2's vocabulary: the default model's tokenizer and chat template
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}  # fmt: skip


def test_a_batch_groups_members_resume_at_its_prefix(
    next_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline batch group's leader snapshots its linear layers at the group prefix's end (its last
    64-token boundary) as well as at its own prompt's, so the members resume there, not from the
    spaced snapshots (forced here to every 1,024 tokens, as a real shape's); tokens as computed whole."""
    from prefixserve.engine import engine_setup

    monkeypatch.setattr(engine_setup, "snapshot_spacing", lambda *a: 1024)
    prefix = _prompt(5, 100)  # its boundary at 64; each prompt's own at 128
    prompts = [{"prompt_token_ids": prefix + _prompt(30 + i, 40)} for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in _llm(next_model, enable_prefix_caching=False).generate(prompts, greedy)
    ]
    llm = _llm(next_model)
    assert llm.engine.blocks.states.spacing == 1024
    outs = llm.generate(prompts, greedy, schedule="batch")
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.metrics()["prefix_cache_hit_tokens_total"] == 3 * 64  # the members, from the mark
    assert_pool_empty(llm)


@pytest.mark.usefixtures("default_tokenizer")
def test_a_pinned_system_prompts_snapshot_is_never_evicted(tmp_path: Path) -> None:
    """A pinned system prompt's linear-layer snapshot is held with its blocks: after other prompts
    cycle every evictable snapshot slot, a chat opening with the pinned prompt still resumes from it,
    its tokens as computed whole."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_HYBRID))
    system = "You are the travel desk's assistant. " * 12  # over 64 tokens as the template renders it
    args = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, "block_size": 8, "progress": False}
    llm = LLM(f"dummy:{path}", system_prompts={"desk": system}, max_num_seqs=1, **args)
    plain = LLM(f"dummy:{path}", enable_prefix_caching=False, **args)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for seed in (3, 4, 5):  # each takes snapshots at tokens 64 and 128: the unpinned slot cycles
        llm.generate({"prompt_token_ids": _prompt(seed, 150)}, greedy)
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "Where to?"}]
    before = llm.metrics()["prefix_cache_hit_tokens_total"]
    got = llm.chat(chat, greedy, application="desk")[0].outputs[0].token_ids
    assert llm.metrics()["prefix_cache_hit_tokens_total"] - before >= 64
    assert got == plain.chat(chat, greedy)[0].outputs[0].token_ids


def test_launched_ahead_the_tokens_samples_and_hits_are_the_same(
    next_model: Path, chat_replies: Replies
) -> None:
    """With launch-ahead (a step launched before the tokens of the one in flight are known): a chat's
    turns resume after each reply (the output's snapshots named once their tokens are known), n = 3
    greedy samples each equal the one greedy sequence and seeded ones the reference's (each sample's
    copy of the prompt's end states runs before the parent's next step, launched ahead or not)."""
    plain = _llm(next_model, enable_prefix_caching=False, async_scheduling=False)
    ahead = _llm(next_model, async_scheduling=True)
    assert ahead.engine.config.async_scheduling
    _chat_turns(chat_replies, ahead)
    prompts = [{"prompt_token_ids": _prompt(40 + i, 30 + 37 * i)} for i in range(2)]
    one = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, one)]
    group = SamplingParams(temperature=0.0, n=3, max_tokens=16, ignore_eos=True)
    outs = ahead.generate(prompts, group)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w] * 3 for w in want]
    seeded = SamplingParams(temperature=0.8, n=3, seed=3, max_tokens=12, ignore_eos=True)
    samples = [[c.token_ids for c in o.outputs] for o in ahead.generate(prompts, seeded)]
    assert samples == [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, seeded)]
    assert_pool_empty(ahead)
    assert ahead.engine.blocks.states.num_held == 0


def test_prompt_cache_schemas_are_refused(tmp_path: Path) -> None:
    tiny_checkpoint("qwen3_5_text", tmp_path)
    llm = _llm(tmp_path)
    with pytest.raises(ValueError, match="out of position on its linear layers"):
        llm.engine.register_schema('<schema name="s"><module name="m">hello</module></schema>')
    with pytest.raises(ValueError, match="out of position"):
        _llm(tmp_path, schemas=['<schema name="s"><module name="m">hello</module></schema>'])


def test_a_multimodal_qwen3_5_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """``Qwen3_5ForConditionalGeneration`` as published: ``text_config``, the language model's tensors
    under ``model.language_model.``, the vision tower's (``model.visual.``) left at load; text logits
    equal the text model's."""
    text = {**SIZES, **LINEAR, **ROPE, **FAMILIES["qwen3_5_text"]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 72}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    _randomize(hf)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    model, _ = load_model(ModelSource("hf", tmp_path, "qwen3.5-mm"), torch.float32, torch.device("cpu"))
    assert model.config.architecture == "qwen3_5" and model.config.linear_layers == [0, 1, 3]
    ids = _prompt(4, 30)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1:]
    torch.testing.assert_close(prefill_logits(model, ids)[-1:], ref, rtol=1e-4, atol=1e-4)


BAD = [
    ({"layer_types": ["linear_attention"] * 2}, "only linear_attention layers"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads=3 dividing linear_num_value_heads=4"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' RoPE is not supported"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_hybrid_configs_that_contradict_themselves_are_refused(change, message) -> None:
    import re

    base = {"architectures": ["Qwen3_5ForCausalLM"], **SIZES, **LINEAR, "num_hidden_layers": 2}
    base["layer_types"] = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict({**base, **change})


def test_samples_wait_for_their_slots_and_a_failed_step_leaves_no_snapshot(next_model: Path) -> None:
    """A hybrid runs at most max_num_seqs sequences, forked samples included: a request's n samples
    wait for slots instead of failing the batch (and n over max_num_seqs is refused at intake); a
    step that fails mid-forward gives up the snapshots it was to write, so a later hit recomputes
    instead of resuming from a half-written state."""
    from prefixserve.model.gated_delta import GatedDeltaNet

    llm = _llm(next_model, max_num_seqs=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       prompt_token_ids=_prompt(1, 12))  # fmt: skip
    engine.add_request("b", None, SamplingParams(temperature=0.0, n=3, max_tokens=4, ignore_eos=True),
                       prompt_token_ids=_prompt(2, 12))  # fmt: skip
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = {c.finish_reason for c in out.outputs}
    assert reasons == {"a": {"length"}, "b": {"length"}}
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate({"prompt_token_ids": _prompt(3, 8)}, SamplingParams(n=4, max_tokens=2))
    x = {"prompt_token_ids": _prompt(4, 70)}
    want = _llm(next_model, enable_prefix_caching=False).generate(x, greedy)[0].outputs[0].token_ids
    one = _llm(next_model, max_num_seqs=1)
    assert one.generate(x, greedy)[0].outputs[0].token_ids == want
    for seed in (5, 6):  # x's snapshot evicted (two snapshot slots: twice max_num_seqs)
        one.generate({"prompt_token_ids": _prompt(seed, 70)}, greedy)
    forward, failing = GatedDeltaNet.forward, [True]

    def fails_once(self, h, step):
        if self.layer == 1 and failing[0] and step.snapshots and any(step.snapshots):
            failing[0] = False
            raise RuntimeError("a failure half way through the forward (as a CUDA OOM)")
        return forward(self, h, step)

    GatedDeltaNet.forward = fails_once
    try:
        assert one.generate(x, greedy)[0].outputs[0].finish_reason == "error"
    finally:
        GatedDeltaNet.forward = forward
    assert one.generate(x, greedy)[0].outputs[0].token_ids == want
    assert_pool_empty(one)


def test_a_checkpoints_multi_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    """Published Qwen3-Next and Qwen3.5 checkpoints carry a draft head (``mtp.*``), which HF skips at
    load; so does the engine (it runs no draft head), and the model is HF's."""
    from safetensors.torch import load_file, save_file

    from tests.test_model_families import assert_logits_match_hf

    hf = tiny_checkpoint("qwen3_next", tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    weights = load_file(str(file))
    hidden = hf.config.hidden_size
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    weights["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(8, hidden)
    save_file(weights, str(file), metadata={"format": "pt"})
    assert_logits_match_hf(("mtp", tmp_path, hf), (9,))
