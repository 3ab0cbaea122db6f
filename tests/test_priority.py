"""Priority scheduling (``scheduling_policy="priority"``, vLLM's ``--scheduling-policy priority``).

The waiting queue is ordered by (priority, arrival) and the running sequence preempted for blocks is
the one latest in that order; under ``fcfs`` only priority 0 is taken. Checked on the policy alone
(random queues against a sort), on the engine (the order requests start in, greedy text unchanged,
preemption under a small pool), and over HTTP (a 400 naming ``priority`` under fcfs).
"""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import engine_checks
import httpx
import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.entrypoints.openai.server import ServerThread, build_app
from prefixserve.scheduler.policy import FirstCome, PriorityFirst, check_priority, queue_policy


def _seq(priority: int, arrival: float) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(priority=priority, arrival_time=arrival))


@pytest.mark.parametrize("seed", range(20))
def test_the_queue_is_ordered_by_priority_then_arrival(seed: int) -> None:
    rng = random.Random(seed)
    seqs = [_seq(rng.randint(-3, 3), float(i)) for i in range(rng.randint(1, 40))]
    policy, waiting = PriorityFirst(), deque()
    for seq in rng.sample(seqs, len(seqs)):  # arrival order need not be enqueue order (requeued ones)
        policy.enqueue(waiting, seq)
    keys = [(s.request.priority, s.request.arrival_time) for s in waiting]
    assert keys == sorted(keys)
    running = rng.sample(seqs, len(seqs))
    victim = policy.victim(running)
    assert (victim.request.priority, victim.request.arrival_time) == max(keys)


def test_first_come_keeps_arrival_order() -> None:
    a, b, c = _seq(0, 0.0), _seq(0, 1.0), _seq(0, 2.0)
    policy, waiting = FirstCome(), deque()
    for seq in (b, c):
        policy.enqueue(waiting, seq)
    policy.requeue(waiting, a)  # preempted: back at the front
    assert list(waiting) == [a, b, c] and policy.victim([a, b, c]) is c
    with pytest.raises(ValueError, match="scheduling_policy"):
        queue_policy("lottery")
    with pytest.raises(ValueError, match="priority 3 needs the priority scheduling policy"):
        check_priority(3, "fcfs")
    with pytest.raises(ValueError, match="priority must be an integer"):
        check_priority(True, "priority")
    check_priority(-5, "priority")
    check_priority(0, "fcfs")


def _finish_order(engine: Engine, prompts: dict[str, tuple[str, int]], params: SamplingParams) -> list[str]:
    for rid, (prompt, priority) in prompts.items():
        engine.add_request(rid, prompt, params, priority=priority)
    order, texts = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                texts[out.request_id] = out.outputs[0].text
    return order, texts


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_start_in_priority_order_with_the_same_text(tiny_config_path: Path, policy: str) -> None:
    """One sequence at a time: the queue's order is the finishing order; each greedy text is the
    one it has alone."""
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, max_num_seqs=1,
        scheduling_policy=policy,
    )  # fmt: skip
    engine = Engine(config, progress=False)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = {"late": ("a bicycle", 0), "later": ("a tandem", 1), "urgent": ("a unicycle", -1)}
    if policy == "fcfs":
        prompts = {rid: (prompt, 0) for rid, (prompt, _) in prompts.items()}
    order, texts = _finish_order(engine, prompts, params)
    assert order == (["urgent", "late", "later"] if policy == "priority" else ["late", "later", "urgent"])
    alone = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, progress=False)
    for rid, (prompt, _) in prompts.items():
        assert texts[rid] == alone.generate([prompt], params)[0].outputs[0].text
    if policy == "fcfs":
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("x", "hi", params, priority=2)
        assert not engine.has_unfinished()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_least_urgent_running_request_is_preempted(tiny_config_path: Path, device: str) -> None:
    """A pool too small for every request's output, the low-priority requests started first: each
    preemption takes the least urgent request running then, never an urgent one while a low-priority
    one runs (first come first served would take the urgent ones, admitted last); every text is
    still its greedy one. On CUDA: under decode graphs and steps launched ahead."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device=device, dtype="float32", num_kv_blocks=24, max_num_seqs=8,
        scheduling_policy="priority",
    )  # fmt: skip
    engine = Engine(config, progress=False)
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": (f"ride number {i} " * 3, 1 if i < 3 else -1) for i in range(6)}
    preempted: list[str] = []
    original = engine.scheduler._preempt

    def noting(seq, out):  # type: ignore[no-untyped-def]
        key = (seq.request.priority, seq.request.arrival_time)
        others = [(s.request.priority, s.request.arrival_time) for s in engine.scheduler.running]
        assert key == max(others), "a more urgent request was preempted while a less urgent one ran"
        preempted.append(seq.request.request_id)
        original(seq, out)

    engine.scheduler._preempt = noting  # type: ignore[method-assign]
    texts = {}
    for rid, (prompt, priority) in prompts.items():
        engine.add_request(rid, prompt, params, priority=priority)
        if priority == 1:
            engine.step()  # the low-priority ones run before the urgent ones arrive
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    assert any(prompts[rid][1] == 1 for rid in preempted), "the pool was meant to be too small"
    alone = LLM(
        model=f"dummy:{tiny_config_path}", device=device, dtype="float32", num_kv_blocks=128, progress=False
    )
    for rid, (prompt, _) in prompts.items():
        assert texts[rid] == alone.generate([prompt], params)[0].outputs[0].text
    assert engine_checks.blocks_in_use(engine) == 0


def test_priority_over_http(tiny_config_path: Path) -> None:
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, scheduling_policy="priority"
    )
    with ServerThread(build_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        for route, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": -3}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                      "priority": 7}),
        ]:  # fmt: skip
            got = http.post(route, json=body)
            assert got.status_code == 200, got.text
        got = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": "high"})
        assert got.status_code == 400 and got.json()["error"]["param"] == "priority"
        engine_checks.wait_server_pool_empty(srv)


def test_offline_generate_takes_a_priority_per_prompt(tiny_config_path: Path) -> None:
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, max_num_seqs=1,
        scheduling_policy="priority", progress=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = llm.generate(["a bicycle", "a tandem", "a unicycle"], params, priority=[2, 1, 0])
    finished = [o.metrics["finish_time"] for o in outs]
    assert finished[2] < finished[1] < finished[0]  # one at a time, the smallest value first
    with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
        llm.generate(["a", "b"], params, priority=[1])


def test_admission_counts_only_those_sorting_before(tiny_config_path: Path) -> None:
    """The queue deadline's wait estimate, at arrival and between steps, counts the requests ahead in
    the queue's order: an urgent request behind ten low-priority ones is admitted and kept."""
    from prefixserve.serving.admission import Admission, AdmissionLimits

    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, max_num_seqs=1,
        scheduling_policy="priority",
    )  # fmt: skip
    engine = Engine(config, progress=False)
    now = [100.0]
    admission = Admission(engine, AdmissionLimits(100, 0), clock=lambda: now[0])
    admission.rate, admission.token_rate = 1.0, 1e9  # one request starts a second
    params = SamplingParams(max_tokens=50, temperature=0.0)
    engine.add_request("running", "x", params, admit=admission.gate())
    engine.step()
    for i in range(10):
        engine.add_request(f"low{i}", f"low {i}", params, priority=5, admit=admission.gate())
    engine.add_request("urgent", "urgent", params, priority=-5, admit=admission.gate(deadline=now[0] + 5.0))
    assert engine.scheduler.waiting[0].request.request_id == "urgent"
    admission.before_step()  # ten seconds of queue in arrival order, none ahead in the queue's
    assert "urgent" in engine.requests
    for rid in list(engine.requests):
        engine.abort(rid)
