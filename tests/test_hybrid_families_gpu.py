"""Linear-attention hybrids on a GPU: tiny random Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints
(power-of-two heads, as the Triton attention kernels take) in fp32 and bf16 on CUDA; the Gated
DeltaNet rule on ``fla-core``'s kernels (skipped without it): the chunked and fused recurrent forms
against the PyTorch reference on random shapes and slots, and greedy tokens equal to HF's on the same
device, with the Triton attention backend and the reference, chunked prefill, prefix-cache hits
resumed from state snapshots, preemption and n > 1."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model.gated_delta_ref import prepare_qk, recurrent_ref
from tests.conftest import assert_pool_empty
from tests.test_hybrid_families import FAMILIES, _chat_turns, tiny_checkpoint
from tests.test_model_families import _prompt

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("lens", [[1, 1, 1], [70, 1, 130], [5, 64, 1, 9]])
def test_fla_forms_equal_the_reference(lens: list[int]) -> None:
    """One variable-length step over slots (some fresh, some continuing) equals the reference per
    sequence; the final states land in the slots."""
    from prefixserve.model import gated_delta_fla

    gen = torch.Generator(device="cuda").manual_seed(0)
    kh, vh, dk, dv, tokens = 2, 4, 64, 32, sum(lens)
    q, k = (torch.randn(tokens, kh, dk, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(tokens, vh, dv, device="cuda", generator=gen)
    g = -torch.rand(tokens, vh, device="cuda", generator=gen)
    beta = torch.rand(tokens, vh, device="cuda", generator=gen)
    state = torch.randn(8, vh, dk, dv, device="cuda", generator=gen)
    slots, fresh = [5, 1, 7, 2][: len(lens)], [i % 2 == 0 for i in range(len(lens))]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    before = state.clone()
    out = gated_delta_fla.run(
        q, k, v, g, beta, gated_delta_fla.lists_on(q.device, slots, starts, fresh), state
    )
    qf, kf = prepare_qk(q, k, vh)
    for s, slot in enumerate(slots):
        a, b = starts[s], starts[s + 1]
        start = torch.zeros_like(before[slot]) if fresh[s] else before[slot]
        want, want_state = recurrent_ref(qf[a:b], kf[a:b], v[a:b], g[a:b], beta[a:b], start)
        torch.testing.assert_close(out[a:b].float(), want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(state[slot], want_state, rtol=2e-3, atol=2e-3)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    return directory, tiny_checkpoint(request.param, directory)


def test_greedy_tokens_equal_hf_on_cuda(family) -> None:
    directory, hf = family
    prefix = _prompt(5, 80)  # a snapshot at token 64: hits resume there
    prompts = [{"prompt_token_ids": prefix + _prompt(20 + i, 5 + 3 * i)} for i in range(6)]
    # plain greedy on both sides: under min_tokens the engine also holds back its tokenizer's EOS
    # (SmolLM2's <|im_end|>, id 2), which HF's min_new_tokens does not (it knows only the config's)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    args = {
        "model": str(directory),
        "dtype": "float32",
        "device": "cuda",
        "block_size": 16,
        "progress": False,
    }
    plain = LLM(attention="reference", num_kv_blocks=256, max_num_batched_tokens=64, **args)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    fast = LLM(attention="triton", num_kv_blocks=256, max_num_batched_tokens=128, **args)
    for _ in range(2):  # the second round: every prompt from the snapshot (fla's kernels in rounds)
        assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want
    assert fast.metrics()["prefix_cache_hit_tokens_total"] >= 6 * 64
    small = LLM(attention="triton", num_kv_blocks=14, **args)  # preempted and recomputed
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == want
    group = SamplingParams(temperature=0.0, n=3, max_tokens=24, ignore_eos=True)
    assert [[c.token_ids for c in o.outputs] for o in fast.generate(prompts[:2], group)] == [
        [w] * 3 for w in want[:2]
    ]
    hf = hf.cuda()
    hf.generation_config.eos_token_id = None  # 24 greedy tokens, none held back
    for p, w in zip(prompts[:2], want[:2], strict=True):
        ids = p["prompt_token_ids"]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        assert out[0, len(ids) :].tolist() == w
    for llm in (plain, fast, small):
        assert_pool_empty(llm)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_decode_graphs_give_the_eager_steps_tokens(tmp_path, quantization) -> None:
    """Decode under CUDA graphs (the state slots in the graphs' input rows, shared-prefix attention in
    the graph, launched ahead) gives the eager steps' tokens: greedy behind a shared prefix, seeded
    samples n=3 (each sample's states copied before its first graphed step), and a chat's later turns
    resumed from the snapshots its replies' graphed steps took; with FP8 weights too (every projection,
    the linear layers' own included)."""
    tiny_checkpoint("qwen3_next", tmp_path)
    args = {"model": str(tmp_path), "dtype": "float32", "device": "cuda", "block_size": 16}
    args |= {"attention": "triton", "num_kv_blocks": 256, "progress": False, "quantization": quantization}
    eager = LLM(enforce_eager=True, **args)
    graphed = LLM(**args)
    prefix = _prompt(5, 80)
    prompts = [{"prompt_token_ids": prefix + _prompt(20 + i, 5 + 3 * i)} for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, n=3, seed=3, max_tokens=12, ignore_eos=True)
    for params in (greedy, seeded):
        want = [[c.token_ids for c in o.outputs] for o in eager.generate(prompts, params)]
        assert [[c.token_ids for c in o.outputs] for o in graphed.generate(prompts, params)] == want
    _chat_turns(eager, graphed)
    assert graphed.engine.runner.graphs.captures > 0 and eager.engine.runner.graphs is None
    for llm in (eager, graphed):
        assert_pool_empty(llm)
        assert llm.engine.blocks.states.num_held == 0


def test_a_dummy_hybrid_runs_in_bf16() -> None:
    """A dummy Qwen3.5-35B-A3B-shaped model at 4 layers would not fit a test; the shipped shapes'
    linear layers at their real head sizes (16 key heads, 32 value heads of 128) run a few steps."""
    config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 1000}
    config |= {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4}
    config |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256}
    config |= {"linear_num_key_heads": 16, "linear_num_value_heads": 32}
    config |= {"linear_key_head_dim": 128, "linear_value_head_dim": 128}
    import json
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "hybrid.json"
    path.write_text(json.dumps(config))
    llm = LLM(model=f"dummy:{path}", dtype="bfloat16", device="cuda", max_num_seqs=8, progress=False)
    outs = llm.generate(
        [{"prompt_token_ids": _prompt(i, 100 + 50 * i)} for i in range(4)], SamplingParams(max_tokens=8)
    )
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
