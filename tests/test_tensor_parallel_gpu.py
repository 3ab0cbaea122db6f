"""Tensor parallelism on GPUs (NCCL): greedy outputs over 2 (and 4) GPUs equal one GPU's, decode steps
under CUDA graphs with their all-reduces captured. Needs 2 CUDA GPUs, the 4-rank case 4 (skipped
elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from prefixserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.parametrize("attention, peer", [("auto", True), ("triton_paged", True), ("auto", False)])
def test_two_gpus_equal_one_under_cuda_graphs(tiny_config_path: Path, attention: str, peer: bool) -> None:
    """fp32 greedy tokens over 2 GPUs equal one GPU's, with steps launched ahead (fed from each rank's
    own sharded argmax, replayed from its graph) and decode-sized all-reduces over peer memory
    (``peer``) or all through NCCL."""
    _ranks_equal_one(tiny_config_path, 2, attention, peer)


def test_min_tokens_ban_over_two_gpus_equals_one(tiny_config_path: Path) -> None:
    """Steps whose rows are under their min_tokens gather the logits to rank 0 for the ban (no sharded
    argmax), later steps take the sharded argmax again: fp32 tokens over 2 GPUs equal one GPU's, greedy
    and seeded, with the stop id and EOS skewed far ahead so that the ban decides every early token."""
    prompts = [{"prompt_token_ids": [(11 * i) % 30000 + 100 for i in range(40 + j)]} for j in range(5)]
    skew = {777: 50.0, 2: 40.0}
    cases = [
        SamplingParams(
            max_tokens=14, temperature=t, seed=5, min_tokens=9, stop_token_ids=[777], logit_bias=skew
        )
        for t in (0.0, 1.0)
    ]
    kwargs = dict(model=f"dummy:{tiny_config_path}", dtype="float32", num_kv_blocks=256, progress=False)
    single = LLM(**kwargs)
    want = [[o.outputs[0].token_ids for o in single.generate(prompts, p)] for p in cases]
    del single
    assert all(len(ids) == 10 and ids[-1] == 777 and 2 not in ids for w in want for ids in w)
    with LLM(tensor_parallel_size=2, **kwargs) as tp:
        assert tp.engine.launch_ahead
        got = [[o.outputs[0].token_ids for o in tp.generate(prompts, p)] for p in cases]
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
@pytest.mark.parametrize("peer", [True, False])
def test_four_gpus_equal_one_under_cuda_graphs(tiny_config_path: Path, peer: bool) -> None:
    """The same over 4 GPUs: past two ranks the norms sum the ranks' products with
    ``kernels/ranks_norm.py`` (or NCCL sums them), the argmax's exchange is NCCL's, and the tiny
    model's 2 KV heads are replicated (each rank holds one of the 4 query heads and its KV head)."""
    _ranks_equal_one(tiny_config_path, 4, "auto", peer)


def _ranks_equal_one(tiny_config_path: Path, ranks: int, attention: str, peer: bool) -> None:
    shared = [(7 * i) % 40000 + 100 for i in range(200)]
    prompts = [{"prompt_token_ids": [*shared, 1000 + j, 2000 + j]} for j in range(6)]
    prompts.append({"prompt_token_ids": [5, 6, 7]})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kwargs = dict(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        attention=attention,
        num_kv_blocks=256,
        progress=False,
    )
    single = LLM(**kwargs)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    del single
    from prefixserve.worker.tp_runner import peer_used_in_process

    first = not peer_used_in_process()  # only a process's first engine takes the peer all-reduce
    with LLM(tensor_parallel_size=ranks, tp_peer_allreduce=peer, **kwargs) as tp:
        assert tp.engine.launch_ahead
        assert (tp.engine.runner.shard.peer is not None) is (peer and first)
        if peer and first:  # the norms after attention and the MLP sum over NVLink themselves
            assert tp.engine.runner.shard.peer.fused is not None
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
        assert got == want
        assert tp.engine.graphs is not None and tp.engine.graphs.captures > 0, "decode left CUDA graphs"
        argmax_graphs = tp.engine.runner.argmax_graphs
        assert argmax_graphs is not None and argmax_graphs.graphs, "the sharded argmax ran eagerly"


def test_a_dead_worker_fails_the_servers_requests(tiny_config_path: Path) -> None:
    """Over 2 GPUs (NCCL, peer memory): a killed worker fails requests with an error and /health goes
    503; nothing hangs in a collective."""
    pytest.importorskip("fastapi")
    from prefixserve.config import EngineConfig
    from tests.test_tensor_parallel import server_survives_a_dead_worker

    config = EngineConfig(model=f"dummy:{tiny_config_path}", num_kv_blocks=256, tensor_parallel_size=2)
    server_survives_a_dead_worker(config)


def test_a_worker_killed_mid_decode_leaves_no_peer_kernel_waiting(tiny_config_path: Path) -> None:
    """Kill worker 1 while rank 0 decodes over the peer kernels: the generation fails with the
    worker's death, and rank 0's GPU drains (their waits read the abort flag the watcher raises)
    instead of spinning for the life of the process. In a process of its own: only a process's
    first tensor-parallel engine takes the peer kernels."""
    import subprocess
    import sys

    script = Path(__file__).with_name("tp_dead_peer.py")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_config_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    error, state = done.stdout.split()[-2:]
    assert error == "WorkerDiedError", done.stdout + done.stderr[-3000:]
    assert state == "DRAINED", "rank 0's GPU still runs a kernel waiting for the dead rank"
