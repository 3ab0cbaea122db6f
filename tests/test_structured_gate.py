"""Gated grammar masks (``structured/gate.py``): the device, not the engine's thread, waits for a step's
fill. On the CPU the device's wait is played by ``HostGate`` (the kernel's loop on the host), over
the real matcher process and shared slots: a fill sent with the accepts of the step ahead is the one
its step's mask waits for; a step whose samplers differ from the guess, or that had none sent ahead,
sends its own when its sampling is issued; the child writes every other row of the n as all allowed
and then the fill's number, or its negation when the step fails, which ``check`` turns into an error.
The masks equal a matcher's of the same tokens. The kernel itself: ``tests/kernels/test_fill_gate.py``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixserve import SamplingParams
from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.sampling.token_mask import apply_token_mask
from prefixserve.structured import bitmask, decoding
from prefixserve.structured.gate import FillGate
from tests.conftest import tiny_cascade_llm

xgr = pytest.importorskip("xgrammar")

SPEC = StructuredOutputs(regex=r"[0-9]{2,4}-[ab]{3}")


class HostGate:
    """``FillGate`` with the kernel's wait on the host: spin on the slot's flag, then mask."""

    def __init__(self, device: Any) -> None:
        self.timeout = 30.0
        self._seen_np = [0, 0]
        self._late_np = [0, 0]  # (the flagged argmax's: a program that masked without the verdict)
        self._spins = [0, 0]
        self.applied = 0

    def apply(self, logits: Any, slots: Any, flags: Any, slot: int, number: int, rows: int) -> None:
        deadline = time.monotonic() + self.timeout
        while int(flags[slot]) not in (number, -number) and time.monotonic() < deadline:
            time.sleep(1e-4)
        self._seen_np[slot] = int(flags[slot])
        apply_token_mask(logits[:rows], slots[slot][:rows].clone(), None)
        self.applied += 1

    def argmax(self, logits: Any, slots: Any, flags: Any, slot: int, number: int, rows: int) -> Any:
        self.apply(logits, slots, flags, slot, number, rows)
        return logits.argmax(-1)

    check = FillGate.check


@pytest.fixture(scope="module")
def engine(tiny_config_path: Path) -> Iterator[Any]:
    llm = tiny_cascade_llm(tiny_config_path, async_scheduling=True)
    yield llm.engine
    llm.shutdown()


@pytest.fixture
def gated(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[decoding.StructuredDecoding]:
    monkeypatch.setattr(bitmask.StepBitmasks, "device_readable", property(lambda self: True))
    monkeypatch.setattr(decoding, "FillGate", HostGate)
    eos = set(engine.eos_ids)
    sd = decoding.StructuredDecoding(engine.tokenizer, engine.model_config.vocab_size, eos, rows=4)
    sd.admit(SPEC)
    assert sd.gated
    yield sd
    sd.close()


def _seqs(engine: Any, n: int, spec: StructuredOutputs | None = SPEC) -> list[Any]:
    params = SamplingParams(max_tokens=8, structured_outputs=spec)
    reqs = [engine.add_request(f"g{time.monotonic_ns()}-{i}", "x", params, queue=False) for i in range(n)]
    return [r.sequences[0] for r in reqs]


def _allowed(sd: decoding.StructuredDecoding, tokens: list[int]) -> torch.Tensor:
    """bool [vocab]: what a fresh matcher of SPEC allows after ``tokens``."""
    matcher = xgr.GrammarMatcher(sd.grammars.get(SPEC))
    for t in tokens:
        assert matcher.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, sd.grammars.info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    vocab = sd.grammars.info.vocab_size
    return ~bitmask.blocked_tokens(mask, vocab)[0]


def _masked(sd: decoding.StructuredDecoding, mask: Any, rows: int) -> torch.Tensor:
    logits = torch.zeros(rows, sd.words * 32)
    mask.apply(logits)
    return logits != float("-inf")


def test_a_step_with_no_fill_ahead_sends_its_own(gated: Any, engine: Any) -> None:
    seqs = _seqs(engine, 1) + _seqs(engine, 1, spec=None)  # a constrained row and a free one
    mask = gated.gated_mask(seqs)
    assert mask is not None and mask.fill.number == 1
    got = _masked(gated, mask, 2)
    vocab = gated.grammars.info.vocab_size
    assert torch.equal(got[0, :vocab], _allowed(gated, []))
    assert got[1].all()  # the free row: every token allowed
    gated.advance(seqs, [len(s.token_ids) for s in seqs], [0, 0], {})  # its tokens (none placed) come back
    assert not gated._issued and gated.gated_mask(_seqs(engine, 1, spec=None)) is None


def test_a_greedy_step_is_chosen_by_its_gated_mask(gated: Any, engine: Any) -> None:
    """Greedy rows alone, nothing processed: the runner takes the mask's own choice (on a GPU the wait,
    the mask and the argmax in one launch), the argmax of the masked logits; else the mask applies."""
    seqs = _seqs(engine, 1) + _seqs(engine, 1, spec=None)
    mask = gated.gated_mask(seqs)
    logits = torch.randn(2, gated.words * 32)
    want = logits.clone()
    mask.apply(want)
    runner, greedy = engine.runner, [SamplingParams(temperature=0.0)] * 2
    chosen = runner._choose(logits.clone(), greedy, [None, None], mask, None, None, fp32=False)
    assert chosen.result().tokens == want.argmax(-1).tolist()
    assert gated.gate.applied == 2  # the choice waited for the fill, as the mask did
    sampled = [SamplingParams(temperature=1.0, seed=3)] * 2
    processed = logits.clone()
    runner._choose(processed, sampled, [None, None], mask, None, None, fp32=True).result()
    assert torch.equal(processed, want) and gated.gate.applied == 3  # the mask applied, then sampled
    gated.advance(seqs, [len(s.token_ids) for s in seqs], [0, 0], {})


def test_fill_numbers_wrap_below_two_to_the_31(gated: Any, engine: Any) -> None:
    """The flagged argmax takes a fill's number as a 32-bit argument: after 2**31 - 1 it is 1 again."""
    seqs = _seqs(engine, 1)
    gated._number = decoding.NUMBERS - 1
    numbers = []
    for _ in range(2):
        mask = gated.gated_mask(seqs)
        numbers.append(mask.fill.number)
        _masked(gated, mask, 1)
        gated.advance(mask.fill.samplers, [len(seqs[0].token_ids)], [0], {})
    assert numbers == [decoding.NUMBERS, 1]


def test_a_fill_sent_with_the_tokens_ahead_is_its_steps(gated: Any, engine: Any) -> None:
    (seq,) = _seqs(engine, 1)
    digit = gated.grammars.info.decoded_vocab.index(b"7")
    first = len(seq.token_ids)
    seq.token_ids.append(-1)  # the step ahead's placeholder
    nxt = [seq]  # the next step's samplers, whose sampling waits for the step ahead's tokens
    gated.advance([seq], [first], [digit], {seq: [(first, None, 0)]}, then=nxt)
    ahead = gated._ahead
    assert ahead is not None and gated.fills_ahead == 1
    mask = gated.gated_mask([seq])  # the same sequences in another list: the fill sent ahead
    assert mask.fill is ahead
    got = _masked(gated, mask, 1)
    assert torch.equal(got[0, : gated.grammars.info.vocab_size], _allowed(gated, [digit]))
    gated.advance([seq], [first + 1], [digit], {})  # a list of its own: not that step's tokens
    assert len(gated._issued) == 1
    gated.advance(mask.fill.samplers, [first + 1], [digit], {})  # that step's: its wait saw its fill
    assert not gated._issued


def test_a_guess_that_missed_is_sent_again_for_the_step(gated: Any, engine: Any) -> None:
    a, b = _seqs(engine, 2)
    gated.advance([], [], [], {}, then=[a])  # the guess: the same samplers as before
    guess = gated._ahead
    mask = gated.gated_mask([a, b])  # the step came with another sampler
    assert mask.fill is not guess and mask.fill.number == guess.number + 1
    assert mask.fill.slot != guess.slot
    got = _masked(gated, mask, 2)
    vocab = gated.grammars.info.vocab_size
    assert torch.equal(got[:, :vocab], _allowed(gated, []).expand(2, vocab))


def test_a_failed_fill_is_flagged_and_fails_its_step(gated: Any, engine: Any) -> None:
    seqs = _seqs(engine, 1)
    indices = [len(seqs[0].token_ids)]
    step = gated.matchers.step

    def unknown_key(accepts: Any, fill: Any, number: Any = None) -> None:
        slots, slot, n, rows = fill
        step(accepts, (slots, slot, n, [(r, -1) for r, _ in rows]), number)

    gated.matchers.step = unknown_key
    try:
        mask = gated.gated_mask(seqs)
    finally:
        del gated.matchers.step
    _masked(gated, mask, 1)
    assert int(gated.masks.shared.flags[mask.fill.slot]) == -mask.fill.number
    with pytest.raises(RuntimeError, match="failed in the matcher process"):
        gated.advance(seqs, indices, [0], {})
    # the child goes on: the next step's fill is flagged with its own number
    mask = gated.gated_mask(seqs)
    _masked(gated, mask, 1)
    gated.advance(seqs, indices, [0], {})
    assert int(gated.masks.shared.flags[mask.fill.slot]) == mask.fill.number


def test_a_wait_that_saw_another_number_fails(gated: Any) -> None:
    gate = HostGate(None)
    gate._seen_np = [5, 0]
    gate.check(0, 5)
    with pytest.raises(TimeoutError, match="did not come in time"):
        gate.check(0, 6)


def test_an_error_of_accepts_before_fails_the_next_gated_fill(gated: Any, engine: Any) -> None:
    """An accept the child could not take (no answer was due) fails the next gated fill: that fill's
    matchers may be off."""
    (seq,) = _seqs(engine, 1)
    gated.matchers.step(([-5], [1]), None)  # a key the child never made
    mask = gated.gated_mask([seq])
    _masked(gated, mask, 1)
    assert int(gated.masks.shared.flags[mask.fill.slot]) == -mask.fill.number
    with pytest.raises(RuntimeError, match="failed in the matcher process"):
        gated.advance(mask.fill.samplers, [len(seq.token_ids)], [0], {})


def test_a_child_that_dies_releases_the_fill_the_device_waits_for(gated: Any, engine: Any) -> None:
    (seq,) = _seqs(engine, 1)
    child = gated.matchers._child
    os.kill(child.pid, signal.SIGSTOP)
    mask = gated.gated_mask([seq])  # in the socket; the child never takes it
    os.kill(child.pid, signal.SIGKILL)
    started = time.monotonic()
    _masked(gated, mask, 1)
    assert time.monotonic() - started < 10  # released by the child's end, not the wait's bound
    assert int(gated.masks.shared.flags[mask.fill.slot]) == -mask.fill.number
    with pytest.raises(RuntimeError, match="failed in the matcher process"):
        gated.advance(mask.fill.samplers, [len(seq.token_ids)], [0], {})
    with pytest.raises(RuntimeError, match="restarted"):  # the next send meets the dead child
        gated.gated_mask(_seqs(engine, 1))
    (fresh,) = _seqs(engine, 1)
    mask = gated.gated_mask([fresh])  # a new child serves it
    got = _masked(gated, mask, 1)
    assert torch.equal(got[0, : gated.grammars.info.vocab_size], _allowed(gated, []))


def test_a_hung_child_is_replaced_when_a_wait_runs_out(gated: Any, engine: Any) -> None:
    (seq,) = _seqs(engine, 1)
    child = gated.matchers._child
    gated.gate.timeout = 0.5
    os.kill(child.pid, signal.SIGSTOP)
    mask = gated.gated_mask([seq])
    _masked(gated, mask, 1)
    with pytest.raises(RuntimeError, match="did not come in time"):
        gated.advance(mask.fill.samplers, [len(seq.token_ids)], [0], {})
    assert child.wait(timeout=10) is not None and gated.matchers._conn is None  # killed, replaced next
    gated.gate.timeout = 30.0
    (fresh,) = _seqs(engine, 1)
    mask = gated.gated_mask([fresh])
    got = _masked(gated, mask, 1)
    assert torch.equal(got[0, : gated.grammars.info.vocab_size], _allowed(gated, []))
