"""Structured decoding launched ahead: the accept and the mask's fill sent to the matcher process, the
masked sampling issued just ahead of the next forward. Every mask equals the synchronous engine's, row
by row, and so do the outputs; a fill sent ahead is taken by its own step only, an error in the
matcher process fails that step's requests, and a sampling that fails also fails the batch assembled
behind it; the process ends with the engine.

The tests share one synchronous engine and one launched ahead (``llms``): each engine's first
constrained request starts its matcher process, seconds of imports and set-up. Each test leaves them
idle, their pools empty and their methods as it found them (``monkeypatch``); a test that ends one
takes it out of ``llms`` (a later test makes another), one that needs a new engine makes its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.structured_outputs import StructuredOutputs
from tests.conftest import assert_pool_empty, tiny_cascade_llm

xgr = pytest.importorskip("xgrammar")

RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputs(json={"type": "array", "items": RECORD, "minItems": 3}),
    StructuredOutputs(regex=r"[0-9]{2,4}-[ab]{3}"),
    StructuredOutputs(choice=["alpha", "beta", "gamma delta"]),
]


def _params() -> list[SamplingParams]:
    out = []
    for i in range(12):
        spec = SPECS[i % len(SPECS)] if i % 4 != 3 else None  # unconstrained rows in the same batches
        stop = ["-"] if i == 4 else None  # a stop string ends a constrained row mid-grammar
        out.append(SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, stop=stop, structured_outputs=spec))
    return out


class Engines(dict[bool, LLM]):
    """The tiny model's cascade engines by ``async_scheduling`` (synchronous, launched ahead), each
    made at its first use."""

    def __init__(self, config_path: Path) -> None:
        super().__init__()
        self.config_path = config_path

    def __missing__(self, ahead: bool) -> LLM:
        llm = self[ahead] = tiny_cascade_llm(self.config_path, async_scheduling=ahead)
        return llm


@pytest.fixture(scope="module")
def llms(tiny_config_path: Path) -> Iterator[Engines]:
    engines = Engines(tiny_config_path)
    yield engines
    for llm in engines.values():
        llm.shutdown()


def _record_masks(llm: Any, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int, int], bytes]:
    """Each masked row's words by (request id, sample, output position), as the runner's sampling
    gets them (each row's sequence: the rows the rules' adjusts were asked for just before)."""
    masks: dict[tuple[str, int, int], bytes] = {}
    runner, rules = llm.engine.runner, llm.engine.rules
    sample, adjust, last = runner.sample, rules.adjust, []

    def rows_of(rows: Any, params: Any) -> Any:
        last[:] = list(rows)
        return adjust(rows, params)

    def recording(launch: Any, rows: Any, params: Any, generators: Any, mask: Any = None, *rest: Any) -> None:
        if mask is not None:
            for r in mask.rows:
                seq = last[r]
                key = (seq.request.request_id, seq.index, len(seq.token_ids))
                masks[key] = mask.bitmask[r].numpy().tobytes()
        return sample(launch, rows, params, generators, mask, *rest)

    monkeypatch.setattr(rules, "adjust", rows_of)
    monkeypatch.setattr(runner, "sample", recording)
    return masks


def ahead_fills(llm: Any) -> int:
    """How many steps' fills the engine sent with the tokens of the step before (``advance(then=)``);
    none before its first constrained request (structured decoding is set up then)."""
    structured = llm.engine.structured
    return 0 if structured is None else structured.fills_ahead


def busy_device(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner reports its device busy at every sampling launched ahead: the tokens are taken after
    the next forward went out (a GPU-bound step's order), not at once (a host-bound step's)."""
    monkeypatch.setattr(llm.engine.runner, "device_idle", lambda: False)


@pytest.mark.parametrize("idle", [True, False])
def test_masks_and_outputs_equal_the_synchronous_engine(
    llms: Engines, idle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [f"prompt number {i}: answer" for i in range(12)]
    runs, sent_ahead = {}, []
    for ahead in (False, True):
        llm = llms[ahead]
        if not idle:
            busy_device(llm, monkeypatch)
        masks = _record_masks(llm, monkeypatch)
        fills = ahead_fills(llm)
        outs = llm.generate(prompts, _params())
        texts = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        order = {o.request_id: i for i, o in enumerate(outs)}  # the engines' request ids differ
        runs[ahead] = (texts, {(order[rid], *rest): words for (rid, *rest), words in masks.items()})
        assert_pool_empty(llm)
        sent_ahead.append(ahead_fills(llm) - fills)
    (sync_texts, sync_masks), (ahead_texts, ahead_masks) = runs[False], runs[True]
    assert ahead_texts == sync_texts
    assert len(sync_masks) > 100
    assert ahead_masks.keys() == sync_masks.keys()
    assert all(ahead_masks[k] == sync_masks[k] for k in sync_masks)
    assert any(reason == "stop" for rows in sync_texts for _, reason in rows)
    assert sent_ahead[0] == 0 and sent_ahead[1] > 10  # launched ahead, the fills went with the tokens


@pytest.mark.parametrize("idle", [True, False])
def test_constrained_sampling_goes_out_just_ahead_of_the_next_forward(
    llms: Engines, idle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Launched ahead, a constrained step's sampling is followed by the next forward. A device busy
    with the forward before keeps it queued (no wait between them) while the host fills the next mask;
    an idle one (a host-bound step) has the sampling's tokens back at once, so the host waits for them
    first and the next mask is filled while the forward is issued."""
    llm = llms[True]
    if not idle:
        busy_device(llm, monkeypatch)
    calls: list[str] = []
    runner = llm.engine.runner
    for name in ("forward", "sample", "wait"):
        fn = getattr(runner, name)
        monkeypatch.setattr(
            runner, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1]
        )
    spec = StructuredOutputs(json={"type": "array", "items": RECORD, "minItems": 8})
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec)
    llm.generate([f"p{i}" for i in range(4)], params)
    trace = "".join(c[0] for c in calls)  # forward, sample, wait
    # the first step is sampled at once (nothing ahead of it); then each step: the sampling of the
    # step ahead, this step's forward, the wait for the tokens ahead (which fills the next mask); on an
    # idle device that wait comes before the forward
    steps = (len(trace) - 6) // 3
    each = "swf" if idle else "sfw"
    assert steps > 10 and trace == "fs" + "fw" + each * steps + "sw"


def test_worker_job_is_taken_by_its_own_step_only(llms: Engines) -> None:
    llm = llms[True]
    engine = llm.engine
    sd = engine._structured()
    llm.generate(["warm"], SamplingParams(max_tokens=4, structured_outputs=SPECS[1]))
    req = engine.add_request("a", "x", SamplingParams(max_tokens=8, structured_outputs=SPECS[1]))
    seq = req.sequences[0]
    status = seq.status
    try:
        samplers = [seq]
        sd.advance([], [], [], {}, then=samplers)  # a job for `samplers`: its mask filled on the worker
        assert sd._job is not None and sd._job[0] is samplers
        other = sd.bitmask([seq])  # another step's list: filled now, the job joined and dropped
        assert sd._job is None and other is not None and other.rows == [0]
        sd.advance([], [], [], {}, then=samplers)
        seq.status = type(seq.status).FINISHED  # finished while the worker filled: left unmasked
        assert sd.bitmask(samplers) is None
    finally:  # the shared engine as it was: the request never stepped goes
        seq.status = status
        engine.abort("a", report=False)
    assert sd._job is None
    assert_pool_empty(llm)


def test_an_error_in_the_matcher_process_fails_its_step_and_the_batch_behind(
    llms: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = llms[True]
    sd = llm.engine._structured()
    step, failures = sd.matchers.step, []

    def failing(accepts: Any, fill: Any) -> None:
        if fill is not None and not failures:  # a key the child never made: its fill answers an error
            failures.append(1)
            accepts = ([*accepts[0], -1], [*accepts[1], 0])
        step(accepts, fill)

    monkeypatch.setattr(sd.matchers, "step", failing)
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SPECS[0])
    outs = llm.generate([f"q{i}" for i in range(3)], params)
    assert failures and all(o.outputs[0].finish_reason == "error" for o in outs)
    assert_pool_empty(llm)
    (out,) = llm.generate(["again"], SamplingParams(max_tokens=12, structured_outputs=SPECS[1]))
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert_pool_empty(llm)


def test_a_matcher_process_started_ahead_is_used_and_an_unused_one_ends(tiny_config_path: Path) -> None:
    """A GPU engine starts its matcher process with the engine (``StructuredOutputsRule``): the first
    constrained request sets that one up; one never used ends with the engine all the same."""
    from prefixserve.engine.request_rules import STRUCTURED
    from prefixserve.structured.matcher_process import MatcherProcess

    llm = tiny_cascade_llm(tiny_config_path, async_scheduling=True)
    rule = llm.engine.rules.find(STRUCTURED)
    ahead = rule._matchers = MatcherProcess()  # what a GPU engine's rule does at construction
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=6, structured_outputs=SPECS[1]))
    assert llm.engine.structured.matchers is ahead and rule._matchers is None
    assert out.outputs[0].finish_reason in ("stop", "length")
    unused_llm = tiny_cascade_llm(tiny_config_path, async_scheduling=True)
    unused = unused_llm.engine.rules.find(STRUCTURED)._matchers = MatcherProcess()
    for engine_llm, child in ((llm, ahead._child), (unused_llm, unused._child)):
        engine_llm.shutdown()
        assert child.wait(timeout=30) == 0


def _valid(llm: Any, outs: list[Any], spec: StructuredOutputs) -> bool:
    """Every output's tokens accepted by a matcher of ``spec``'s grammar, replayed here."""
    compiled = llm.engine.structured.grammars.get(spec)
    for o in outs:
        matcher = xgr.GrammarMatcher(compiled)
        if not all(matcher.accept_token(t) for t in o.outputs[0].token_ids):
            return False
    return True


@pytest.mark.parametrize("ahead", [False, True])
def test_grammars_hold_after_a_failed_step_that_followed_a_good_one(
    llms: Engines, ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails in the matcher process after earlier ones succeeded (the slots already
    mapped there) fails its requests only: later requests are still masked by their grammar."""
    llm = llms[ahead]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs=SPECS[1])
    assert _valid(llm, llm.generate(["warm", "up"], params), SPECS[1])
    sd = llm.engine.structured
    step, failures = sd.matchers.step, []

    def failing(accepts: Any, fill: Any) -> None:
        if fill is not None and not failures:
            failures.append(1)
            accepts = ([*accepts[0], -1], [*accepts[1], 0])
        step(accepts, fill)

    monkeypatch.setattr(sd.matchers, "step", failing)
    (failed,) = llm.generate(["fails"], params)
    assert failures and failed.outputs[0].finish_reason == "error"
    outs = llm.generate([f"again {i}" for i in range(6)], params)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert _valid(llm, outs, SPECS[1])
    assert_pool_empty(llm)


def test_a_matcher_process_that_dies_fails_its_step_and_is_replaced(llms: Engines) -> None:
    import os
    import signal

    llm = llms[True]
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SPECS[1])
    llm.generate(["warm"], params)
    sd = llm.engine.structured
    first = sd.matchers._child
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    outs = llm.generate(["a", "b"], params)  # the step that meets the dead child fails
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    outs = llm.generate(["c", "d"], params)  # a new child serves the next ones
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs) and _valid(llm, outs, SPECS[1])
    assert sd.matchers._child is not first and sd.matchers._child.poll() is None
    (plain,) = llm.generate(["e"], SamplingParams(max_tokens=4))
    assert plain.outputs[0].finish_reason == "length"
    assert_pool_empty(llm)


def test_the_child_makes_before_it_drops_and_compiles_beside_its_steps(llms: Engines) -> None:
    """``Matchers`` (the child's state) on its own: a key made and dropped in one step is not held
    after it; a spec sent to compile is compiled on the thread and taken by the matcher made of it; a
    key not held fails the step after the others took their tokens."""
    from prefixserve.structured.matcher_process import Matchers

    llm = llms[False]
    tok = llm.get_tokenizer()
    sd = llm.engine._structured()
    matchers = Matchers(sd.grammars.info.serialize_json(), len(tok), 1)
    matchers.compile(SPECS[0])
    matchers.step([(1, SPECS[0]), (2, SPECS[1])], [2], ([], []), None)
    assert set(matchers.by_key) == {1} and not matchers._compiling
    bracket = tok.convert_tokens_to_ids("[")
    with pytest.raises(KeyError, match="not held"):
        matchers.step([], [], ([1, 99], [bracket, 5]), None)
    assert not matchers.by_key[1].accept_token(bracket)  # it took the first "[": a second is refused


def test_the_matcher_process_ends_with_the_engine(llms: Engines) -> None:
    llm = llms[True]  # the shared engine launched ahead (made now if no test made it), ended here:
    del llms[True]  # a later test makes another
    llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=SPECS[1]))
    child = llm.engine.structured.matchers._child
    assert child.poll() is None
    llm.shutdown()
    assert child.wait(timeout=10) == 0
