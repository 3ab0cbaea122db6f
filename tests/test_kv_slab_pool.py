"""The prefix spill's pinned slots: reused, never freed, handed out oldest first, guarded by the event
of their last read; and the spill over them: bit-exact, allocation-free, filling the host tier."""

from __future__ import annotations

import pytest
import torch

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache
from prefixserve.kv.prefix_spill import PrefixSpill
from prefixserve.kv.slab_pool import SlabPool
from prefixserve.kv.tiers import HostTier
from prefixserve.kv.transfer import copy_stream
from tests.test_kv_tiers import TINY


class PendingEvent:
    """A copy still running: the host must never wait on it (the device does)."""

    def synchronize(self) -> None:
        raise AssertionError("the host waited on a slot's event")


def pool(capacity: int = 6, slab_slots: int = 4, prealloc: bool = False) -> SlabPool:
    return SlabPool((2, 3), torch.float32, capacity, pin=False, slab_slots=slab_slots, prealloc=prealloc)


def test_slots_are_reused_without_new_slabs() -> None:
    p = pool()
    assert p.allocations == 0  # lazy without prealloc
    slots, waits = p.acquire(3)
    assert slots == [0, 1, 2] and waits == [] and p.allocations == 1
    ptr = p.view(1).data_ptr()
    for _ in range(50):
        p.release(slots)
        slots, _ = p.acquire(3)
    assert p.allocations == 1 and p.view(1).data_ptr() == ptr
    assert pool(prealloc=True).allocations == 2  # 6 slots in slabs of 4: two, all made up front


def test_the_ring_hands_out_the_oldest_released_and_wraps_over_slabs() -> None:
    p = pool()
    a, _ = p.acquire(4)
    b, _ = p.acquire(2)  # the second slab (two slots of its four are within capacity)
    assert (a, b, p.allocations, p.available) == ([0, 1, 2, 3], [4, 5], 2, 0)
    with pytest.raises(RuntimeError):
        p.acquire(1)
    p.release([2, 3])
    p.release(b)
    p.release([0])
    got, _ = p.acquire(5)
    assert got == [2, 3, 4, 5, 0] and p.allocations == 2
    # runs: consecutive ids within one slab, split at the slab's end
    runs = p.runs(got)
    assert [(start, run.shape[0]) for start, run in runs] == [(0, 2), (2, 2), (4, 1)]
    assert runs[0][1].data_ptr() == p.view(2).data_ptr() and runs[1][1].data_ptr() == p.view(4).data_ptr()
    p.runs(got)[1][1].fill_(7.0)  # views: writes reach the slots
    assert torch.equal(p.view(5), torch.full((2, 3), 7.0))


def test_a_slot_comes_back_with_its_last_readers_event_for_the_device_to_wait_on() -> None:
    p = pool()
    slots, _ = p.acquire(6)
    read = PendingEvent()
    p.release(slots[:3], read)  # a copy out of these may still run
    p.release(slots[3:])
    got, waits = p.acquire(4)
    assert got == [0, 1, 2, 3] and waits == [read]  # once, however many of its slots come back
    got, waits = p.acquire(2)
    assert got == [4, 5] and waits == []


def test_copy_out_into_slots_on_a_cpu() -> None:
    p = pool()
    slots, waits = p.acquire(4)
    src = torch.arange(24, dtype=torch.float32).view(4, 2, 3)
    for start, run in p.runs(slots):
        copy_stream("cpu").copy_out(run, src[start : start + run.shape[0]], waits)
    assert torch.equal(torch.stack([p.view(s) for s in slots]), src)


def spill_setup(host_blocks: int, device: str = "cpu") -> tuple[BlockPool, KVCache, HostTier, PrefixSpill]:
    config = TINY
    kv = KVCache(config, 8, 4, torch.bfloat16, torch.device(device))
    gen = torch.Generator().manual_seed(1)
    kv.tensor.copy_(torch.randn(tuple(kv.tensor.shape), generator=gen).to(torch.bfloat16))
    block_bytes = kv.tensor[:, :, 0].numel() * kv.tensor.element_size()
    host = HostTier(host_blocks * block_bytes, pin=device == "cuda")
    blocks = BlockPool(8, 4)
    return blocks, kv, host, PrefixSpill(blocks, kv, host)


def digest(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_spill_round_trip_is_bit_exact_and_takes_the_entries_out(device: str) -> None:
    """On a GPU with no sync between the spill, the restore and the read: events order them."""
    blocks, kv, host, spill = spill_setup(host_blocks=4, device=device)
    want = {b: kv.tensor[:, :, b].clone() for b in (6, 2, 5)}
    spill.save([(6, digest(0)), (2, digest(1)), (5, digest(2))])
    kv.tensor[:, :, [6, 2, 5]] = 0  # the pool reuses the evicted blocks
    got = spill.restore([digest(0), digest(1), digest(2), digest(9)])
    assert len(got) == 3 and spill.restored_blocks == 3
    for block, src in zip(got, (6, 2, 5), strict=True):
        assert torch.equal(kv.tensor[:, :, block].view(torch.int16), want[src].view(torch.int16))
        assert blocks.cached_block(digest((6, 2, 5).index(src))) == block
    assert len(host) == 0 and spill.slots.available == spill.slots.capacity  # slots back
    assert spill.slots.allocations == 1 and (device == "cpu" or spill.slots.slabs[0].is_pinned())
    blocks.check_integrity()


def test_spill_fills_the_host_tier_and_reuses_its_slots() -> None:
    _blocks, kv, host, spill = spill_setup(host_blocks=5)
    for round_ in range(6):  # 18 blocks through a 5-block tier: the oldest pushed out, slots reused
        spill.save([(b, digest(3 * round_ + i)) for i, b in enumerate((1, 3, 4))])
    assert spill.host_capacity_blocks == 5 and len(host) == 5
    assert host.keys() == ["p-" + digest(i).hex() for i in range(13, 18)]
    assert spill.slots.allocations == 1 and spill.slots.available == 0
    spill.save([(b, digest(100 + b)) for b in range(7)])  # more than the tier holds: the newest 5
    assert host.keys() == ["p-" + digest(100 + b).hex() for b in range(2, 7)]
    for b in range(2, 7):
        entry = host.get("p-" + digest(100 + b).hex())
        assert entry is not None and torch.equal(entry[0], kv.tensor[:, :, b])


def test_a_restore_does_not_push_out_the_entries_asked_for_next() -> None:
    """Documents asked in turn through a pool and a host tier that hold them all between them: every
    revisit is a hit (reading an entry must not make it the newest: the spill of the blocks its
    restore evicts would push out the next document's)."""
    blocks, _kv, host, spill = spill_setup(host_blocks=8)  # 8 device blocks + 8 host = 4 docs of 4
    docs = [[digest(10 * d + i) for i in range(4)] for d in range(4)]
    hits = 0
    for round_ in range(3):
        for doc in docs:
            found = blocks.lookup(doc)
            blocks.acquire(found)
            more = spill.restore(doc[len(found) :])
            held = found + more
            hits += len(held)
            if len(held) < 4:
                fresh = blocks.allocate(4 - len(held))
                for block, d in zip(fresh, doc[len(held) :], strict=True):
                    blocks.register(block, d)
                held += fresh
            blocks.release(held)
        if round_ == 0:
            assert hits == 0
    assert hits == 2 * 4 * 4 and spill.restored_blocks > 0
    assert len(host) <= 8
    blocks.check_integrity()
