"""The probes' cuBLASLt binding (``benchmarks/harness/blaslt.py``) against ``torch.mm``, on a GPU.

Every candidate cuBLASLt offers for a product (its heuristic list and a slice of the wider search)
must give ``torch.mm``'s product up to accumulation order, eagerly and replayed from a CUDA graph,
with operands that are rows of wider buffers. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import blaslt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(64, 1024, 512), (200, 3072, 1024), (256, 4096, 2048), (96, 768, 4096)]
TILES = (17, 20, 28, 135, 157, 164, 165, 183)  # the tiles the deep search found best at decode shapes


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    scale = float(ref.abs().max()) + 1e-6
    err = float((out.float() - ref.float()).abs().max())
    assert bool(torch.isfinite(out).all()) and err <= 0.02 * scale, err


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
    assert len(blaslt.candidates(problem, x.device, max_workspace=0)) <= len(seeds)
    wider = blaslt.variants(problem, x.device, seeds[:1], tiles=TILES, customs=(0, 5))
    assert wider, "no configuration beyond the heuristic's list was accepted"
    for algo in seeds + wider[:24]:
        out.fill_(float("nan"))
        blaslt.matmul_into(x, w, out, algo)
        _close(out, ref)
        assert set(blaslt.describe(algo)) >= {"tile", "split_k", "cluster", "custom"}


def test_graph_replay_and_strided_operands() -> None:
    x_buf = torch.randn(128, 1536, device="cuda", dtype=torch.bfloat16)
    x = x_buf[:, :1024]  # rows of a wider buffer
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 32
    out_buf = torch.empty(128, 2560, device="cuda", dtype=torch.bfloat16)
    out = out_buf[:, :2048]
    assert blaslt.supported(x, w, out)
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
