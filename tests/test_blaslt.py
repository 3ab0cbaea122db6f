"""The probes' cuBLASLt binding without a GPU: the problem it describes and the tensors it refuses
(the calls themselves run in ``test_blaslt_gpu.py``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from benchmarks.harness import blaslt


def test_structs_match_the_library() -> None:
    assert ctypes.sizeof(blaslt.Algo) == 64  # cublasLtMatmulAlgo_t
    assert ctypes.sizeof(blaslt._Heuristic) == 96  # cublasLtMatmulHeuristicResult_t


def test_problem_reads_strides() -> None:
    x = torch.randn(300, 256)[:, :128]  # rows of a wider buffer
    w = torch.randn(64, 128)
    assert blaslt.Problem.of(x, w) == blaslt.Problem(300, 64, 128, torch.float32, 256, 128, 64)
    out = torch.empty(300, 96)[:, :64]
    assert blaslt.Problem.of(x, w, out).out_stride == 96


def test_supported_refuses_what_it_cannot_call() -> None:
    x, w = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(32, 128, dtype=torch.bfloat16)
    assert not blaslt.supported(x, w)  # CPU tensors
    assert not blaslt.supported(x.float(), w.float())
    assert not blaslt.available() or torch.cuda.is_available()


def test_matmul_into_names_bad_operands() -> None:
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    with pytest.raises(ValueError, match="fp16/bf16"):
        blaslt.matmul_into(x, w, torch.empty(64, 32), blaslt.Algo())
