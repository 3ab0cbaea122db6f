"""The host side of a hybrid's state slots: snapshot counts and spacing, least-recently-used
eviction, and a running sequence's chunk-end snapshot superseding its last one."""

from __future__ import annotations

import torch

from prefixserve.kv.state_slots import StateSlots, bytes_per_slot, slot_counts, snapshot_spacing
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader import CONFIG_DIR


def test_slot_counts_and_the_memory_cap() -> None:
    assert slot_counts(8, True, 16) == (8, 16, 64)
    assert slot_counts(8, False, 16) == (8, 0, 64)
    assert slot_counts(8, True, 16, snapshot_room=5) == (8, 5, 64)
    assert slot_counts(8, True, 128) == (8, 16, 128)  # a block past 64 tokens: every block


def test_spacing_matches_a_snapshot_to_the_kv_of_as_many_tokens() -> None:
    """Qwen3.5-27B: a ~154 MB slot against 64 KB of KV a token (16 full layers): 2,048 tokens (a power
    of two times 64 at or under the ~2,350 that balance)."""
    config = ModelConfig.from_json(CONFIG_DIR / "qwen3.5-27b.json")
    slot = bytes_per_slot(config, torch.bfloat16)
    kv_token = 2 * 4 * 256 * 2 * 16
    spacing = snapshot_spacing(config, 64, torch.bfloat16)
    assert spacing == 2048 and spacing * kv_token <= slot < 2 * spacing * kv_token


def test_eviction_and_supersession() -> None:
    slots = StateSlots(2, snapshots=3, every_tokens=64, spacing=256)
    first = slots.new_snapshot(b"a", "s1", spaced=True)
    assert first == 2 and slots.new_snapshot(b"a") is None  # held already
    slots.take_copies()  # the step that writes it launched
    b = slots.new_snapshot(b"b", "s1", spaced=False)
    slots.take_copies()
    c = slots.new_snapshot(b"c", "s1", spaced=False)  # supersedes b: its slot given back at once
    assert c == b and b"b" not in slots._snaps and b"a" in slots._snaps
    slots.take_copies()
    slots.new_snapshot(b"o", "s1", spaced=False, output=True)  # in its output: c (its prompt's) stays
    slots.take_copies()
    assert b"c" in slots._snaps and b"o" in slots._snaps
    slots._snap_free.append(slots._snaps.pop(b"o"))  # (as if evicted: room for the rest of the test)
    slots.free("s1")  # its last one (c) stays for the chat's next turn
    assert b"c" in slots._snaps
    slots.new_snapshot(b"d", "s2", spaced=True)
    slots.new_snapshot(b"e", "s2", spaced=True)  # no slot free: the least recently used (a) goes
    assert set(slots._snaps) == {b"c", b"d", b"e"}
    digests = [b"x", b"c"]  # a hit of 8 blocks of 16 tokens resumes at c, its boundary at 128 tokens
    assert slots.snapshot_prefix(digests * 4, 8, 16) == 8


def test_a_pinned_snapshot_leaves_the_eviction_order() -> None:
    slots = StateSlots(1, snapshots=2, every_tokens=64)
    slots.new_snapshot(b"p")
    slots.take_copies()
    assert slots.pin([b"x", b"p"]) == 1
    for digest in (b"a", b"b", b"c"):  # only the other slot cycles
        slots.new_snapshot(digest)
        slots.take_copies()
    assert slots.snapshot_prefix([b"p"] * 4, 4, 16) == 4 and slots.new_snapshot(b"p") is None
    slots.restore("s", b"p")
    assert slots.take_copies() == [(1, 0)]  # the pinned slot (after the one sequence slot) copied in


def test_a_step_never_evicts_a_snapshot_it_writes_itself() -> None:
    """Three snapshots in one step over two slots: the third finds no slot (each slot has one
    writer), where evicting the step's own first one would give one slot two writers."""
    slots = StateSlots(1, snapshots=2, every_tokens=64)
    taken = [slots.new_snapshot(d) for d in (b"a", b"b", b"c")]
    assert taken == [1, 2, None]
    slots.take_copies()  # launched: the next step may still run beside it (launch-ahead)
    assert slots.new_snapshot(b"d") is None
    slots.take_copies()  # two steps on: written
    assert slots.new_snapshot(b"d") == 1 and b"a" not in slots._snaps


def test_output_snapshots_are_named_once_their_tokens_are_known() -> None:
    """Launched ahead, a step feeds a token still on the device: a snapshot in the output is
    reserved then and registered under its block's digest once the tokens are known; one whose
    sequence ends first is given back; one whose digest another holds already is given back."""
    slots = StateSlots(1, snapshots=3, every_tokens=64)
    first = slots.reserve("s", 128, spaced=False)
    assert first is not None and slots.reserve("s", 128, spaced=False) is None
    slots.resolve("s", 64, lambda end: b"x")  # not yet known that far
    assert slots._snaps == {}
    slots.resolve("s", 128, lambda end: {128: b"d128"}[end])
    assert slots._snaps == {b"d128": first}
    again = slots.reserve("t", 128, spaced=False)
    slots.resolve("t", 192, lambda end: b"d128")  # the same states: its slot back
    assert slots._snaps == {b"d128": first} and again in slots._snap_free
    slots.reserve("u", 64, spaced=False)
    slots.free("u")
    assert len(slots._snap_free) == 2 and not slots._pending


def test_a_freed_slot_a_samples_copy_reads_is_kept_back_until_the_copy() -> None:
    """A parent preempted just after its samples were split off: its slot, which their queued copies
    read, goes back only once those copies are taken (else a host restore into it would run first)."""
    slots = StateSlots(3, snapshots=0)
    parent = slots.slot("p")
    slots.fork("p", "c")
    slots.free("p")
    assert slots.slot("new") != parent
    assert slots.take_copies() == [(parent, slots.slot("c"))]
    slots.free("new")
    assert parent in slots._free


def test_a_resolved_snapshot_is_not_evicted_while_its_writer_may_run() -> None:
    slots = StateSlots(1, snapshots=1, every_tokens=64)
    slots.take_copies()
    slots.reserve("s", 64, spaced=True)
    slots.resolve("s", 64, lambda end: b"d")
    assert slots.new_snapshot(b"e") is None  # b"d"'s writer may still run
    slots.take_copies()
    slots.take_copies()
    assert slots.new_snapshot(b"e") is not None and b"d" not in slots._snaps
