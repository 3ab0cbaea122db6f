"""A hybrid's decode graphs' state-slot rows (``worker/linear_graph.py``), on the CPU: a step's slots
and fresh flags land in the rows with the padding on the pool's scratch slot; the layers' view reads
them as device tensors; a capture's warm-up moves only the scratch slot; a decode step's snapshots
are copied after the replay. The graphed steps themselves are tested on a GPU
(``tests/test_hybrid_families_gpu.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prefixserve.kv.state_slots import StatePool
from prefixserve.model.config import ModelConfig
from prefixserve.worker.cuda_graph import graph_refusal
from prefixserve.worker.linear_graph import ROWS, LinearGraphRows

pytest.importorskip("transformers.models.qwen3_5", reason="this transformers has no Qwen3.5")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    from tests.test_hybrid_families import tiny_checkpoint

    directory = tmp_path_factory.mktemp("qwen3_5_graph_rows")
    tiny_checkpoint("qwen3_5_text", directory)
    return ModelConfig.from_json(Path(directory) / "config.json")


def test_a_hybrid_is_not_refused_decode_graphs(config: ModelConfig) -> None:
    assert config.is_hybrid and graph_refusal(config) is None


def test_rows_carry_the_steps_slots_and_pad_on_scratch(config: ModelConfig) -> None:
    pool = StatePool(config, 4, torch.float32, torch.device("cpu"))
    assert (pool.scratch_slot, pool.num_slots) == (4, 5)
    inputs = torch.zeros(3 + ROWS, 8, dtype=torch.long)
    rows = LinearGraphRows(pool, inputs, 3)
    step = pool.step([2, 0, 3], [1, 1, 1], [5, 1, 9])  # the second starts at token 0: fresh
    host = np.full((3 + ROWS, 8), -1, dtype=np.int64)
    rows.fill(host, step, bucket=6)
    assert host[3, :6].tolist() == [2, 0, 3, 4, 4, 4] and host[4, :6].tolist() == [0, 1, 0, 1, 1, 1]
    assert (host[:3] == -1).all()  # the other rows untouched
    inputs.copy_(torch.from_numpy(host))
    view = rows.step(6)
    slots, starts, fresh = view.tensors(torch.device("cpu"))
    assert view.decode and slots.tolist() == [2, 0, 3, 4, 4, 4]
    assert fresh.tolist() == [False, True, False, True, True, True] and starts.tolist() == list(range(7))
    with rows.on_scratch():
        assert inputs[3].tolist() == [4] * 8 and inputs[4].tolist() == [1] * 8
    assert inputs[3, :6].tolist() == [2, 0, 3, 4, 4, 4]  # restored for the replay


def test_a_decode_steps_snapshots_are_copied_after_the_replay(config: ModelConfig) -> None:
    pool = StatePool(config, 4, torch.float32, torch.device("cpu"))
    for conv, state in pool.layers.values():
        conv.copy_(torch.randn(conv.shape))
        state.copy_(torch.randn(state.shape))
    rows = LinearGraphRows(pool, torch.zeros(3 + ROWS, 4, dtype=torch.long), 3)
    rows.after_replay(pool.step([2, 0], [1, 1], [7, 9]))  # no snapshot: nothing moves
    before = {i: (c.clone(), s.clone()) for i, (c, s) in pool.layers.items()}
    rows.after_replay(pool.step([2, 0], [1, 1], [7, 9], snapshots=[[(1, 3)], []]))
    for i, (conv, state) in pool.layers.items():
        assert torch.equal(conv[3], conv[2]) and torch.equal(state[3], state[2])
        assert torch.equal(conv[:3], before[i][0][:3]) and torch.equal(state[:3], before[i][1][:3])
