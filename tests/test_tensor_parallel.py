"""Tensor parallelism on the CPU (gloo): one model over several processes gives what one process gives.

The default model has 9 query heads and 3 KV heads: 3 ranks hold 3 and 1 each, with a third of the
MLP columns and of the vocabulary. A tiny dummy model with 1 KV head over 2 ranks covers KV heads
replicated across ranks, one with 3 KV heads sharing off over 3 ranks. Greedy outputs must equal the
single-process engine's, with sharing on and off; a killed worker must fail the engine at once with
an error naming it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.entrypoints.openai.server import ServerThread, build_app
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader import load_model, resolve_model
from prefixserve.model.parallel import Shard, WorkerDiedError, check_divisible
from tests.conftest import TINY_CONFIG, assert_pool_empty

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
# the default model's outputs over 3 ranks: 4 tokens (a prefill's and 3 decodes'), each decode step
# meets the ranks in 60 all-reduces (0.6 s a step on the 2-core CI machine)
SHORT = SamplingParams(max_tokens=4, temperature=0.0)
SHARED = "You are a careful assistant for a bicycle shop. Answer briefly and politely. " * 6
PROMPTS = [SHARED + q for q in ("How do I fix a flat tyre?", "What is a derailleur?", "Which saddle?")]
PROMPTS += ["The capital of France is", "1, 2, 3, 4,"]
SCHEMA = """<schema name="shop">
  <module name="policy">Returns are accepted within thirty days. Repairs take two days.</module>
  <module name="hours">The shop opens at nine and closes at six, every day but Sunday.</module>
</schema>"""
PML = '<prompt schema="shop"><policy/><hours/> When can I collect a repair left on Saturday?</prompt>'


def token_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, SHORT)]


@pytest.fixture(scope="module")
def three_kv_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with 6 query heads and 3 KV heads: 3 ranks hold 2 and 1 each."""
    heads = {"num_attention_heads": 6, "num_key_value_heads": 3}
    cfg = dict(TINY_CONFIG, hidden_size=96, intermediate_size=192, **heads)
    path = tmp_path_factory.mktemp("three_kv") / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with 2 query heads and 1 KV head, and a vocabulary 2 ranks do not split evenly."""
    cfg = dict(TINY_CONFIG, num_attention_heads=2, num_key_value_heads=1, vocab_size=1001, hidden_size=32)
    path = tmp_path_factory.mktemp("one_kv") / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_shard_spans_and_refusals() -> None:
    assert [Shard(r, 3).span(9) for r in range(3)] == [(0, 3), (3, 6), (6, 9)]
    assert [Shard(r, 4).kv_head_span(2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [Shard(r, 2).vocab_span(1001) for r in range(2)] == [(0, 501), (501, 1002)]
    cfg = ModelConfig.from_hf_dict(TINY_CONFIG)  # 4 heads, 2 KV heads, 128 columns
    local = Shard(1, 4).local_config(cfg)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (1, 1, 32)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide.*num_attention_heads=4"):
        check_divisible(cfg, 3)


def test_refused_before_any_worker_starts(tiny_config_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LLM(model=f"dummy:{tiny_config_path}", device="cpu", tensor_parallel_size=3, progress=False)
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("model", ["default", "one_kv_head"])
def test_each_rank_loads_exactly_its_slices(model: str, request: pytest.FixtureRequest) -> None:
    """Every rank's weights are the slices of the whole model's (GGUF-converted HF files, or dummy
    weights drawn whole from the seed); concatenated back they are the whole model."""
    spec = None if model == "default" else f"dummy:{request.getfixturevalue('one_kv_head')}"
    size = 3 if model == "default" else 2
    source = resolve_model(spec)
    whole, _ = load_model(source, torch.float32, torch.device("cpu"), progress=False)
    full = dict(whole.named_parameters())
    ranks = [
        dict(
            load_model(source, torch.float32, torch.device("cpu"), progress=False, shard=Shard(r, size))[
                0
            ].named_parameters()
        )
        for r in range(size)
    ]
    cfg = whole.config
    d, inter, vocab = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for name, tensor in full.items():
        parts = [r[name] for r in ranks]
        if name.endswith("qkv_proj.weight"):
            q = torch.cat([p[: q_rows // size] for p in parts])
            assert torch.equal(q, tensor[:q_rows]), name
            kv_local = parts[0].shape[0] - q_rows // size
            for r, p in enumerate(parts):  # each rank's K and V heads: its own, or its replicated one
                k0, k1 = Shard(r, size).kv_head_span(cfg.num_key_value_heads)
                k = tensor[q_rows + k0 * d : q_rows + k1 * d]
                v = tensor[q_rows + kv_rows + k0 * d : q_rows + kv_rows + k1 * d]
                assert torch.equal(p[q_rows // size : q_rows // size + kv_local // 2], k), name
                assert torch.equal(p[q_rows // size + kv_local // 2 :], v), name
        elif name.endswith("gate_up_proj.weight"):
            assert torch.equal(torch.cat([p[: inter // size] for p in parts]), tensor[:inter]), name
            assert torch.equal(torch.cat([p[inter // size :] for p in parts]), tensor[inter:]), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            joined = torch.cat(parts)
            assert torch.equal(joined[:vocab], tensor), name
            assert not joined[vocab:].any(), f"{name}: padded vocabulary rows must be zero"
        else:
            assert all(torch.equal(p, tensor) for p in parts), name


def test_greedy_equals_one_process_with_sharing_on(default_llm: LLM) -> None:
    """Prefix-shared prompts twice (the second time from the prefix cache), then Prompt Cache modules
    moved to host memory (gathered from every rank) and back (scattered): all as one process gives.
    One engine per process: torch.distributed has one default group."""
    expected = token_ids(default_llm, PROMPTS)
    params = SHORT
    prompts = {mode: {"prompt": PML, "module_recompute": mode} for mode in ("none", "link:8")}
    default_llm.register_schema(SCHEMA)  # the one-process outputs over the schema's modules
    try:
        wants = {mode: default_llm.generate(p, params)[0].outputs[0].token_ids for mode, p in prompts.items()}
    finally:
        default_llm.unregister_schema("shop")
    with LLM(dtype="float32", device="cpu", num_kv_blocks=512, tensor_parallel_size=3, progress=False) as tp:
        assert token_ids(tp, PROMPTS) == expected
        assert token_ids(tp, PROMPTS) == expected
        assert tp.metrics()["prefix_cache_hit_tokens_total"] > 0
        with pytest.raises(RuntimeError, match="already has one"):
            LLM(dtype="float32", device="cpu", tensor_parallel_size=3, progress=False)
        tp.engine.register_schema(SCHEMA)
        # both modes in one batch (a step over 3 ranks costs about the same for two rows as for one): from
        # the ranks' pools, then every module moved to host memory from the 3 ranks and back
        both, want = list(prompts.values()), [wants[mode] for mode in prompts]
        assert [o.outputs[0].token_ids for o in tp.generate(both, params)] == want
        tp.engine.modules.move_out()
        assert [o.outputs[0].token_ids for o in tp.generate(both, params)] == want
        assert tp.metrics()["module_loads_host_total"] >= 2
        tp.engine.modules.move_out()  # the store's own blocks: then none is held
        assert_pool_empty(tp)


class TestThreeKVHeadsOverThreeRanks:
    """One engine over 3 ranks of the tiny model with 3 KV heads (prefix caching off, the reference
    attention), for the greedy test and then the dead-worker test, which kills its worker 1: an
    engine's ranks are ~7 CPU-seconds to start. Class scope: it ends before the module's later tests
    start engines of their own (a process has one default group)."""

    @pytest.fixture(scope="class")
    def off(self, three_kv_heads: Path) -> Iterator[LLM]:
        kwargs = dict(model=f"dummy:{three_kv_heads}", device="cpu", num_kv_blocks=512, progress=False)
        with LLM(tensor_parallel_size=3, attention="reference", enable_prefix_caching=False, **kwargs) as off:
            yield off

    def test_greedy_equals_one_process_with_sharing_off(self, three_kv_heads: Path, off: LLM) -> None:
        """Prefix caching off and the reference attention over 3 ranks of the tiny model with 3 KV
        heads (the default model's ranks are far slower to start and to step on the CI machine's 2
        cores): 10 tokens each, as one process gives them."""
        prompts = PROMPTS[1:4]  # two holders of the shared prefix and a loner
        kwargs = dict(model=f"dummy:{three_kv_heads}", device="cpu", num_kv_blocks=512, progress=False)
        kwargs.update(attention="reference", enable_prefix_caching=False)
        expected = [list(o.outputs[0].token_ids) for o in LLM(**kwargs).generate(prompts, GREEDY)]
        assert [list(o.outputs[0].token_ids) for o in off.generate(prompts, GREEDY)] == expected

    def test_a_dead_worker_lets_the_other_workers_go(self, off: LLM) -> None:
        """The HTTP server runs unchanged over 3 ranks; when worker 1 dies, requests fail and /health
        says 503 instead of the server hanging, and worker 2 ends with the failed request, not with
        the server. (A server over 2 ranks takes the same path, minus the worker left to end.)"""
        server_survives_a_dead_worker(engine=off.engine)


class TestOneKVHeadOverTwoRanks:
    """One engine over 2 ranks (launched ahead) and one single process of the 1-KV-head model, shared
    by these tests (each leaves both idle and their pools empty): a worker's start is ~4 CPU-seconds.
    Their class scope ends them before the module's later tests start engines of their own (a process
    has one default group)."""

    @pytest.fixture(scope="class")
    def single(self, one_kv_head: Path) -> LLM:
        return LLM(model=f"dummy:{one_kv_head}", device="cpu", num_kv_blocks=128, progress=False)

    @pytest.fixture(scope="class")
    def tp(self, one_kv_head: Path) -> Iterator[LLM]:
        kwargs = dict(model=f"dummy:{one_kv_head}", device="cpu", num_kv_blocks=128, progress=False)
        with LLM(tensor_parallel_size=2, async_scheduling=True, **kwargs) as tp:
            yield tp

    def test_replicated_kv_head_and_block_copies(self, single: LLM, tp: LLM) -> None:
        """1 KV head over 2 ranks (each holds it), n=3 samples sharing blocks (copy-on-write), and the
        gathered rows equal one process's."""
        ids = [[5, 17, 300, 42, 7, 99, 1000, 3] * 5, [8, 9, 10]]
        prompts = [{"prompt_token_ids": p} for p in ids]
        seeded = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7)
        for params in (GREEDY, seeded):
            want = [[list(c.token_ids) for c in o.outputs] for o in single.generate(prompts, params)]
            got = [[list(c.token_ids) for c in o.outputs] for o in tp.generate(prompts, params)]
            assert got == want
        blocks = tp.engine.pool.allocate(2), single.engine.pool.allocate(2)
        try:
            packed = single.engine.kv.gather_rows(blocks[1], 20)
            tp.engine.kv.scatter_rows(blocks[0], packed)
            assert torch.equal(tp.engine.kv.gather_rows(blocks[0], 20), packed)
            assert packed.shape[3] == 1  # every head of the model (here one)
        finally:
            tp.engine.pool.release(blocks[0])
            single.engine.pool.release(blocks[1])
        assert_pool_empty(tp)

    def test_launch_ahead_equals_one_synchronous_process(
        self, single: LLM, tp: LLM, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``async_scheduling`` over 2 ranks: each step is launched before the host has the tokens of the
        step ahead, and the workers take them from rank 0's broadcast, or, after the sharded argmax
        (greedy), from their own argmax with no broadcast. Greedy, seeded n=3 and stop-token outputs
        equal one synchronous process's; the rows really were fed, and broadcast only where sampled."""
        ids = [[5, 17, 300, 42, 7, 99, 1000, 3] * 5, [8, 9, 10], [400, 401]]
        prompts = [{"prompt_token_ids": p} for p in ids]
        seeded = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7)
        assert not single.engine.launch_ahead
        expected = {}
        for name, params in (("greedy", GREEDY), ("seeded", seeded)):
            outs = single.generate(prompts, params)
            expected[name] = [[list(c.token_ids) for c in o.outputs] for o in outs]
        stop_at = expected["greedy"][0][0][4]
        stopped = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at])
        outs = single.generate(prompts, stopped)
        expected["stop"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
        assert tp.engine.launch_ahead
        fed: list[bool] = []
        broadcasts: list[int] = []
        forward = tp.engine.runner.forward
        monkeypatch.setattr(
            tp.engine.runner,
            "forward",
            lambda ids, batch, copies, feed=None: (
                fed.append(feed is not None) or forward(ids, batch, copies, feed)
            ),
        )
        broadcast = torch.distributed.broadcast
        monkeypatch.setattr(
            torch.distributed, "broadcast", lambda *a, **k: broadcasts.append(1) or broadcast(*a, **k)
        )
        for name, params in (("greedy", GREEDY), ("seeded", seeded), ("stop", stopped)):
            fed.clear(), broadcasts.clear()
            got = [[list(c.token_ids) for c in o.outputs] for o in tp.generate(prompts, params)]
            assert got == expected[name], name
            assert sum(fed) >= 5, f"{name}: no step was launched ahead with device-fed tokens"
            # the sharded argmax's tokens are on every rank already; sampled ones come from rank 0
            assert len(broadcasts) == (0 if params.temperature == 0.0 else sum(fed)), name
        assert_pool_empty(tp)

    def test_min_tokens_ban_equals_one_process(self, single: LLM, tp: LLM) -> None:
        """Stops banned under min_tokens, and allowed_token_ids (on rank 0's gathered logits, so never
        the sharded argmax) over 2 ranks, launched ahead: the tokens one process gives, greedy and
        seeded."""
        prompts = [{"prompt_token_ids": p} for p in ([5, 17, 300, 42], [8, 9, 10])]
        skew = {999: 50.0, 2: 40.0}  # the stop id, then EOS, far ahead of every other token
        cases = [
            SamplingParams(
                max_tokens=10, temperature=t, seed=7, min_tokens=6, stop_token_ids=[999], logit_bias=skew
            )
            for t in (0.0, 1.0)
        ]
        allowed = [3, 77, 999, 2]  # allowed_token_ids: the same mask, on the same gathered logits
        cases += [
            SamplingParams(max_tokens=8, temperature=t, seed=5, allowed_token_ids=allowed) for t in (0.0, 1.0)
        ]
        want = [[list(c.token_ids) for o in single.generate(prompts, p) for c in o.outputs] for p in cases]
        assert all(len(ids) == 7 and ids[-1] == 999 and 2 not in ids for w in want[:2] for ids in w)
        assert all(set(ids) <= set(allowed) for w in want[2:] for ids in w)
        assert tp.engine.launch_ahead
        got = [[list(c.token_ids) for o in tp.generate(prompts, p) for c in o.outputs] for p in cases]
        assert got == want
        assert_pool_empty(tp)


def test_killed_worker_fails_the_engine_fast(tiny_config_path: Path) -> None:
    cfg = dict(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, progress=False)
    llm = LLM(tensor_parallel_size=2, **cfg)
    try:
        assert len(token_ids(llm, ["hello there"]) if llm.get_tokenizer() else [[1]]) == 1
        worker = llm.engine.runner.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker 1 \(pid \d+\) died with exit code -9"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)
        assert time.monotonic() - started < 15
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.runner.procs)


def server_survives_a_dead_worker(config: EngineConfig | None = None, engine: Engine | None = None) -> None:
    """Serve one request over the ranks of ``config``'s engine (or of ``engine``), kill worker 1: the
    next request fails, /health goes 503 and the other workers end while the server is still up."""
    with (
        ServerThread(build_app(config, engine=engine)) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        body = {"model": "default", "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0}
        first = http.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert http.get("/health").status_code == 200
        assert "prefixserve_generation_tokens_total" in http.get("/metrics").text
        procs = srv.engine_loop.engine.runner.procs
        os.kill(procs[0].pid, signal.SIGKILL)
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code >= 500
        deadline = time.monotonic() + 15
        while http.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http.get("/health").status_code == 503
        # the engine lets the other ranks go now (a worker blocked in a collective is killed after
        # 10 s), not when the server exits
        runner, deadline = srv.engine_loop.engine.runner, time.monotonic() + 30
        while not runner.health.stopping.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert runner.health.stopping.is_set(), "the engine kept its workers after losing one"
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(p.poll() is not None for p in procs), "a live worker outlasted its dead peer"
    assert all(p.poll() is not None for p in procs)


def test_a_failed_start_leaves_no_worker_or_group_and_shutdown_frees_held_graphs(
    tiny_config_path: Path,
) -> None:
    """A start that fails leaves no worker and no process group: a later engine starts as if nothing
    happened. That engine's shutdown then resets every graph it captured (decode, pieces, the sharded
    argmax) before leaving the group, even one that a caller holds a reference to: NCCL's abort waits
    while a captured graph still uses the communicator. (One engine for both: a start is ~4
    CPU-seconds.)"""
    import torch.distributed as dist

    from prefixserve.worker.argmax_graph import ArgmaxGraphs

    class Graph:
        resets = 0

        def reset(self) -> None:
            Graph.resets += 1

    held = ArgmaxGraphs(lambda h: h, (0, 0))
    held.graphs[(1, (4, 8))] = (Graph(), torch.zeros(4))  # type: ignore[assignment]
    held.graphs[(2, (8, 8))] = (Graph(), torch.zeros(8))  # type: ignore[assignment]
    cfg = dict(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, progress=False)
    with pytest.raises(ValueError, match="malformed XML"):
        LLM(tensor_parallel_size=2, schemas=["<schema name='broken'><module"], **cfg)
    assert not dist.is_initialized()
    llm = LLM(tensor_parallel_size=2, **cfg)
    try:
        assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].outputs[0].token_ids
        llm.engine.runner.argmax_graphs = held
    finally:
        llm.shutdown()
    assert Graph.resets == 2 and not held.graphs
    assert llm.engine.runner.argmax_graphs is None


def test_peer_allreduce_is_on_by_default_and_cuda_only() -> None:
    """The symmetric-memory all-reduce is on unless refused, and never on a CPU group (gloo)."""
    from prefixserve.config import EngineConfig
    from prefixserve.entrypoints.args import engine_config_from_args
    from prefixserve.entrypoints.cli import build_parser
    from prefixserve.model.parallel import Shard
    from prefixserve.model.peer_allreduce import peer_allreduce_for

    assert EngineConfig().tp_peer_allreduce is True
    args = build_parser().parse_args(["generate", "hi", "--no-tp-peer-allreduce"])
    assert engine_config_from_args(args).tp_peer_allreduce is False
    args = build_parser().parse_args(["generate", "hi", "--disable-custom-all-reduce"])  # vLLM's name
    assert engine_config_from_args(args).tp_peer_allreduce is False
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_config_from_args(args).tp_peer_allreduce is True
    assert peer_allreduce_for(None, torch.device("cpu"), "x") is None  # type: ignore[arg-type]
    x = torch.ones(4)
    assert Shard().all_reduce(x) is x and Shard().peer is None


def _exited(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_worker_ends_with_rank_0s_process_wherever_it_waits() -> None:
    """Rank 0's process killed while a worker waits somewhere other than its socket (here a sleep,
    standing in for a GPU wait on a kernel that waits for rank 0): the worker's watcher thread ends
    it within a few polls instead of leaving an orphan holding its GPU."""
    import subprocess
    import sys

    child = (
        "import os, time\n"
        "from prefixserve.worker.tp_worker import exit_with_parent\n"
        "exit_with_parent(os.getppid(), poll_s=0.05)\n"
        "print('watching', flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
        "assert p.stdout.readline().strip() == 'watching'\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    rank0 = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env)
    worker = 0
    try:
        worker = int(rank0.stdout.readline())
        assert not _exited(worker)
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 10
        while not _exited(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _exited(worker), "the worker outlived rank 0's process"
    finally:
        rank0.kill()
        if worker and not _exited(worker):  # the test failed: no orphan left behind
            os.kill(worker, signal.SIGKILL)
