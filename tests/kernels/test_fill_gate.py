"""The grammar gate's kernels (``structured/gate.py``): the wait spins until the slot's flag holds the
fill's number, written later by another thread, then the mask read from the host slot equals the
plain-PyTorch reference; a wait that runs out of spins, or that sees the fill's number negated (a
failed fill), is reported by ``check``. On a CPU the kernels run in the Triton interpreter."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _kernel_helpers import DEVICE, compiled_for_hopper

from prefixserve.structured import bitmask
from prefixserve.structured.bitmask import apply_bitmask_reference
from prefixserve.structured.gate import FillGate


@contextlib.contextmanager
def _shared_slots(rows: int, vocab: int) -> Iterator[bitmask.SharedSlots]:
    """Shared slots of ``rows`` rows over ``vocab`` tokens, slot 1 random; pinned on a GPU."""
    shared = bitmask.SharedSlots(rows, -(-vocab // 32))
    pinned = DEVICE.type == "cuda" and bitmask._pin(shared.tensor)
    assert pinned or DEVICE.type == "cpu"
    gen = torch.Generator().manual_seed(rows * vocab)
    shared.tensor[1] = torch.randint(
        -(2**31), 2**31 - 1, shared.tensor[1].shape, generator=gen, dtype=torch.int32
    )
    shared.logits = torch.randn(rows, vocab, generator=gen)
    try:
        yield shared
    finally:
        if pinned:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(shared.tensor.data_ptr())


@pytest.fixture
def slots() -> Iterator[bitmask.SharedSlots]:
    with _shared_slots(3, 5000) as shared:
        yield shared


def _checked(gate: FillGate, issue: Callable[[], Any], slot: int, number: int) -> None:
    """``issue()`` a wait for fill ``number`` in ``slot``, let the device finish, then ``check`` it."""
    issue()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    gate.check(slot, number)


def _waits_for_the_flag(
    slots: bitmask.SharedSlots, slot: int, number: int, issue: Callable[[], object]
) -> Any:
    """``issue()`` while the flag is not set yet (written 0.3 s later): on a GPU the device waits."""
    writer = threading.Timer(0.3, lambda: slots.flags.__setitem__(slot, number))
    writer.start()
    out = issue()
    if DEVICE.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        assert not done.query()  # the device waits for the flag
        done.synchronize()
    writer.join()
    return out


def test_the_gate_waits_for_the_fill_flag_written_later(slots) -> None:
    want = slots.logits.clone()
    apply_bitmask_reference(want, slots.tensor[1], [0, 1, 2])
    gate = FillGate(DEVICE)
    slots.flags[1] = 6
    gate.apply(slots.logits.to(DEVICE), slots.tensor, slots.flags, 1, 6, 3)  # compiled now, not below
    logits = slots.logits.to(DEVICE)
    _waits_for_the_flag(slots, 1, 7, lambda: gate.apply(logits, slots.tensor, slots.flags, 1, 7, 3))
    gate.check(1, 7)
    assert torch.equal(logits.cpu(), want)


def test_a_wait_out_of_spins_or_on_a_failed_fill_is_reported(slots) -> None:
    gate = FillGate(DEVICE)
    gate.set_timeout(0.001)
    logits = slots.logits.to(DEVICE)
    with pytest.raises(TimeoutError, match="did not come in time"):
        _checked(gate, lambda: gate.apply(logits, slots.tensor, slots.flags, 1, 9, 3), 1, 9)
    slots.flags[0] = -4
    with pytest.raises(RuntimeError, match="failed in the matcher process"):
        _checked(gate, lambda: gate.apply(logits, slots.tensor, slots.flags, 0, 4, 3), 0, 4)


@pytest.mark.parametrize(
    "rows, masked, vocab, dtype",
    [
        (3, 3, 5000, torch.float32),
        (5, 2, 2100, torch.bfloat16),
        (1, 1, 1024, torch.float16),
        (4, 4, 3333, torch.float32),
    ],
)
def test_the_flagged_argmax_is_the_masked_argmax(
    rows: int, masked: int, vocab: int, dtype: torch.dtype
) -> None:
    """One launch (and its pick) for greedy rows: rows ``< masked`` choose among the tokens their words
    allow (ties to the first, a NaN where one is allowed), the rest (speculated rows) among all,
    exactly as the mask kernel then ``argmax`` (the engine's other path) choose."""
    with _shared_slots(rows, vocab) as shared:
        gen = torch.Generator().manual_seed(rows * vocab)
        words = torch.randint(-(2**31), 2**31 - 1, shared.tensor[0].shape, generator=gen, dtype=torch.int32)
        shared.tensor[0] = words
        logits = torch.randn(rows, vocab, generator=gen).round(decimals=1).to(dtype)  # ties
        logits[0, 7], logits[-1, vocab - 3] = float("nan"), float("nan")  # one maybe blocked, one not
        want = logits.float().clone()
        apply_bitmask_reference(want, words, list(range(masked)))
        gate = FillGate(DEVICE)
        shared.flags[0] = 11
        for number in (11, 11):  # recorded, then relaunched
            got = gate.argmax(logits.to(DEVICE), shared.tensor, shared.flags, 0, number, masked)
            gate.check(0, number)
            assert torch.equal(got.cpu(), want.argmax(-1))


def test_the_flagged_argmax_waits_for_the_flag_and_reports_a_failed_or_late_fill(slots) -> None:
    want = slots.logits.clone()
    apply_bitmask_reference(want, slots.tensor[1], [0, 1, 2])
    gate = FillGate(DEVICE)
    logits = slots.logits.to(DEVICE)
    slots.flags[1] = 1
    gate.argmax(logits, slots.tensor, slots.flags, 1, 1, 3)  # compiled now, not below
    got = _waits_for_the_flag(slots, 1, 2, lambda: gate.argmax(logits, slots.tensor, slots.flags, 1, 2, 3))
    gate.check(1, 2)
    assert torch.equal(got.cpu(), want.argmax(-1))
    slots.flags[1] = -3
    with pytest.raises(RuntimeError, match="failed in the matcher process"):
        _checked(gate, lambda: gate.argmax(logits, slots.tensor, slots.flags, 1, 3, 3), 1, 3)
    gate.set_timeout(0.001)
    with pytest.raises(TimeoutError, match="did not come in time"):
        _checked(gate, lambda: gate.argmax(logits, slots.tensor, slots.flags, 1, 4, 3), 1, 4)
    slots.flags[1] = 5
    _checked(gate, lambda: gate.argmax(logits, slots.tensor, slots.flags, 1, 5, 3), 1, 5)
    gate.late[1] = 1  # a program that masked before program 0's verdict: the step is not trusted
    with pytest.raises(TimeoutError, match="did not come in time"):
        gate.check(1, 5)


def test_the_polls_are_volatile_and_the_mask_words_plain_in_the_ptx() -> None:
    """The waits poll with ``ld.volatile`` (a plain load in the loop would be hoisted out of it and
    never see the host's write); the mask words are plain vectorised loads, issued after the wait
    (volatile ones, a 32-bit PCIe read each, cost the 135M shape's step 0.8 ms on an H200)."""
    results = {r["kernel"]: r for r in compiled_for_hopper("_host_words_compile.py")}
    assert list(results) == ["flagged_chunk_argmax", "wait_for_fill", "apply_token_mask"]
    assert (
        results["flagged_chunk_argmax"]["volatile_flags"] > 0
        and results["wait_for_fill"]["volatile_flags"] > 0
    )
    for name in ("flagged_chunk_argmax", "apply_token_mask"):
        assert results[name]["plain_words"] > 0 and results[name]["volatile_words"] == 0, results[name]
