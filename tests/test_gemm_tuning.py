"""The per-shape GEMM choice (``prefixserve.model.gemm_tuning``) without a GPU: when it stays out of
the way, how choices persist across restarts and ranks, and what counts as a matching product.
The cuBLASLt calls themselves are tested on a GPU (``test_gemm_tuning_gpu.py``)."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch

from prefixserve.model import blaslt, gemm_tuning


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm_tuning, "_identity", lambda device: "test-gpu|libcublasLt.so.12|torch")
    gemm_tuning.forget()
    yield
    gemm_tuning.forget()


def _algo(fill: int) -> blaslt.Algo:
    algo = blaslt.Algo()
    for i in range(8):
        algo.data[i] = fill * 1000 + i
    return algo


def _problem(m: int, n: int = 4096, k: int = 2048) -> blaslt.Problem:
    return blaslt.Problem(m, n, k, torch.bfloat16, k, k, n)


def test_cpu_tensors_keep_torch() -> None:
    x, w = torch.randn(128, 64), torch.randn(32, 64)
    with gemm_tuning.tuning():
        assert gemm_tuning.product(x, w) is None
    gemm_tuning.register_weights(torch.nn.Linear(64, 32))  # no GPU: nothing registered, nothing loaded
    assert gemm_tuning._siblings == {}


def test_tuning_context_nests() -> None:
    assert not getattr(gemm_tuning._state, "tuning", False)
    with gemm_tuning.tuning():
        with gemm_tuning.tuning():
            assert gemm_tuning._state.tuning
        assert gemm_tuning._state.tuning
    assert not gemm_tuning._state.tuning


def test_problem_of_reads_strides() -> None:
    x = torch.randn(300, 256)[:, :128]  # rows of a wider buffer
    w = torch.randn(64, 128)
    assert blaslt.Problem.of(x, w) == blaslt.Problem(300, 64, 128, torch.float32, 256, 128, 64)
    out = torch.empty(300, 96)[:, :64]
    assert blaslt.Problem.of(x, w, out).out_stride == 96


def test_supported_checks_layout_and_dtype() -> None:
    x, w = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(32, 128, dtype=torch.bfloat16)
    assert not blaslt.supported(x, w)  # CPU tensors
    assert not blaslt.supported(x.float(), w.float())


def test_choices_persist_and_merge(tmp_path: Path) -> None:
    device = torch.device("cuda", 0)
    gemm_tuning._choices[_problem(256)] = _algo(1)
    gemm_tuning._choices[_problem(128)] = None  # torch.mm kept: remembered too
    gemm_tuning._save(device)
    [path] = (tmp_path / "gemm_tuning").glob("*.json")
    saved = json.loads(path.read_text())
    assert len(saved) == 2 and None in saved.values()

    # another rank's process keeps a choice of its own meanwhile: both survive the next save
    other = dict(saved)
    other["64,4096,2048,bfloat16,2048,2048,4096"] = bytes(_algo(7)).hex()
    path.write_text(json.dumps(other))
    gemm_tuning._choices[_problem(192)] = _algo(3)
    gemm_tuning._save(device)
    assert len(json.loads(path.read_text())) == 4

    gemm_tuning.forget()
    gemm_tuning._load(device)
    assert set(gemm_tuning._choices) == {_problem(m) for m in (64, 128, 192, 256)}
    assert gemm_tuning._choices[_problem(128)] is None
    for m, fill in ((256, 1), (64, 7), (192, 3)):
        assert bytes(gemm_tuning._choices[_problem(m)]) == bytes(_algo(fill)), m


def test_unreadable_cache_is_ignored(tmp_path: Path) -> None:
    device = torch.device("cuda", 0)
    path = gemm_tuning._cache_file(device)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    gemm_tuning._load(device)
    assert gemm_tuning._choices == {}


def test_a_choice_must_match_torch() -> None:
    ref = torch.randn(64, 256, dtype=torch.bfloat16)
    assert gemm_tuning._matches(ref.clone(), ref)
    near = (ref.float() * (1 + 2**-8)).to(torch.bfloat16)  # accumulation-order differences
    assert gemm_tuning._matches(near, ref)
    wrong = ref.clone()
    wrong[3, 7] += float(ref.abs().max())
    assert not gemm_tuning._matches(wrong, ref)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert not gemm_tuning._matches(nan, ref)


def test_algo_hex_round_trip() -> None:
    algo = _algo(5)
    assert bytes(gemm_tuning._algo_from_hex(bytes(algo).hex())) == bytes(algo)
    assert ctypes.sizeof(blaslt.Algo) == 64 and ctypes.sizeof(blaslt._Heuristic) == 96
