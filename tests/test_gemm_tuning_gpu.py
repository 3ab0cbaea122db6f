"""cuBLASLt called directly, against ``torch.mm``, on a GPU (skipped elsewhere).

Every candidate cuBLASLt offers for a product (its heuristic list and the tuner's wider search)
must give ``torch.mm``'s product up to accumulation order, eagerly and replayed from a CUDA graph;
the tuner's choice must too, and an engine decode with tuning on must equal one with it off
(greedy, the tiny model in bf16)."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model import blaslt, gemm_tuning

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(64, 1024, 512), (200, 3072, 1024), (256, 4096, 2048), (96, 768, 4096)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path))
    gemm_tuning.forget()
    yield
    gemm_tuning.forget()


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert gemm_tuning._matches(out, ref), float((out.float() - ref.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_candidate_equals_torch(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    ref = torch.mm(x, w.t())
    problem = blaslt.Problem.of(x, w, out)
    seeds = blaslt.candidates(problem, x.device)
    assert seeds, "cuBLASLt offered no candidate"
    wider = blaslt.variants(problem, x.device, seeds[:1], tiles=gemm_tuning.TILES, customs=(0, 5))
    for algo in seeds + wider[:24]:
        out.fill_(float("nan"))
        blaslt.matmul_into(x, w, out, algo)
        _close(out, ref)


def test_graph_replay_and_strided_operands() -> None:
    x_buf = torch.randn(128, 1536, device="cuda", dtype=torch.bfloat16)
    x = x_buf[:, :1024]  # rows of a wider buffer
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 32
    out_buf = torch.empty(128, 2560, device="cuda", dtype=torch.bfloat16)
    out = out_buf[:, :2048]
    algo = blaslt.candidates(blaslt.Problem.of(x, w, out), x.device)[0]
    graph = torch.cuda.CUDAGraph()
    blaslt.matmul_into(x, w, out, algo)
    with torch.cuda.graph(graph):
        blaslt.matmul_into(x, w, out, algo)
    x_buf.normal_()
    out_buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _close(out, torch.mm(x, w.t()))
    assert out_buf[:, 2048:].abs().max() == 0  # nothing written past the view


def test_tuned_product_is_decided_once_and_kept() -> None:
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    layers = torch.nn.ModuleList(torch.nn.Linear(2048, 4096, bias=False) for _ in range(4))
    layers = layers.to("cuda", torch.bfloat16)
    gemm_tuning.register_weights(layers)
    w = layers[1].weight
    assert gemm_tuning.product(x, w) is None  # outside tuning(): undecided keeps torch.mm
    with gemm_tuning.tuning():
        got = gemm_tuning.product(x, w)
    problem = blaslt.Problem.of(x, w)
    assert problem in gemm_tuning._choices
    ref = torch.mm(x, w.t())
    if got is not None:
        _close(got, ref)
    again = gemm_tuning.product(x, w)  # decided: outside tuning() too
    assert (again is None) == (got is None)
    gemm_tuning.forget()
    gemm_tuning.register_weights(layers)  # a restart reads the choice back
    assert problem in gemm_tuning._choices
    assert gemm_tuning.product(torch.randn(256, 2048, device="cuda"), w) is None  # fp32 x: torch


def _greedy(path: str) -> list[list[int]]:
    from prefixserve import LLM, SamplingParams

    llm = LLM(model=f"dummy:{path}", dtype="bfloat16", device="cuda", num_kv_blocks=2048, progress=False)
    prompts = [{"prompt_token_ids": [5 + i, 17, 42, 3 * i + 1, 9]} for i in range(96)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_engine_decode_through_tuned_products(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A bf16 decode of 96 rows with every decided product forced onto cuBLASLt (``MARGIN`` -1: any
    candidate that matches torch.mm's product wins) against the same with tuning off."""
    import json

    from tests.conftest import TINY_CONFIG

    cfg = dict(TINY_CONFIG, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    monkeypatch.setenv("PREFIXSERVE_GEMM_TUNING", "0")
    off = _greedy(str(path))
    assert gemm_tuning._choices == {}
    monkeypatch.setenv("PREFIXSERVE_GEMM_TUNING", "1")
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)
    on = _greedy(str(path))
    assert any(a is not None for a in gemm_tuning._choices.values()), gemm_tuning._choices
    same = sum(a == b for x, y in zip(on, off, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in off)
    assert same >= 0.9 * total, (same, total)  # bf16: accumulation order may flip a near tie
