"""The disk tier's reads and the copy path (issue 54): the chunked xxh3 file format, O_DIRECT and its
fallback, single-flight loads, block-major spill copies and the host tier's pending copies."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.kv import kvfile
from prefixserve.kv.cache import KVCache
from prefixserve.kv.single_flight import SingleFlight
from prefixserve.kv.tiers import DiskTier, HostTier
from prefixserve.kv.transfer import ALIGN, _runs, aligned_bytes, copy_stream
from prefixserve.model.config import ModelConfig
from tests.test_kv_tiers import TINY

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# --- round trips ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(*(st.integers(0, 5),) * 2, st.integers(0, 300), st.integers(1, 4), st.integers(1, 16)),
    seed=st.integers(0, 2**16),
    direct=st.booleans(),
)
def test_disk_round_trip_is_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    seed: int,
    direct: bool,
) -> None:
    store = DiskTier(tmp_path_factory.mktemp("store"), readers=3, chunk_bytes=4096, direct=direct)
    packed = random_tensor(shape, dtype, seed)
    if dtype != torch.bfloat16 and packed.numel():
        packed.view(-1)[0] = float("nan")  # NaN payloads and -0.0 survive too: bytes, not values
        packed.view(-1)[-1] = -0.0
    store.put("k", packed, {"rows": str(shape[2])})
    got = store.get("k")
    assert got is not None
    assert got[0].dtype == dtype and got[0].shape == packed.shape
    assert torch.equal(bits(got[0]), bits(packed)) and got[1] == {"rows": str(shape[2])}
    assert store.corrupt == 0 and store.reads == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_round_trip_through_the_cache_is_bit_exact(dtype: torch.dtype) -> None:
    config = TINY
    cache = KVCache(config, 12, 4, dtype, torch.device("cpu"))
    cache.tensor.copy_(random_tensor(tuple(cache.tensor.shape), dtype, 3))
    host = HostTier(1 << 20, pin=False)
    packed, ready = cache.gather_rows_async([7, 2, 9], 11)
    host.put("m", packed, ready=ready)
    other = KVCache(config, 12, 4, dtype, torch.device("cpu"))
    other.scatter_rows([0, 5, 3], host.get("m")[0])  # type: ignore[index]
    assert torch.equal(bits(other.gather_rows([0, 5, 3], 11)), bits(cache.gather_rows([7, 2, 9], 11)))
    # block-major: each block contiguous across its layers, equal to that block of every layer
    blocks, ready = cache.gather_blocks([4, 1])
    assert blocks.shape == (2, 3, 2, 4, 2, 8) and blocks[0].is_contiguous()
    assert torch.equal(blocks[0], cache.tensor[:, :, 4]) and torch.equal(blocks[1], cache.tensor[:, :, 1])


# --- corruption -----------------------------------------------------------------------------------


def written(tmp_path: Path, rows: int = 100) -> tuple[DiskTier, Path, torch.Tensor]:
    store = DiskTier(tmp_path, readers=2, chunk_bytes=4096)
    packed = random_tensor((2, 2, rows, 2, 8), torch.float32, 11)  # 25,600 bytes: 7 chunks
    store.put("k", packed)
    return store, tmp_path / "k.kv", packed


def test_swapped_chunks_are_caught(tmp_path: Path) -> None:
    store, path, _ = written(tmp_path)
    data = bytearray(path.read_bytes())
    off = kvfile.parse_header(bytes(data)).data_offset
    first, second = data[off : off + ALIGN], data[off + ALIGN : off + 2 * ALIGN]
    data[off : off + 2 * ALIGN] = second + first  # each chunk whole, in the other's place
    path.write_bytes(bytes(data))
    assert store.get("k") is None and store.corrupt == 1 and not path.exists()


def test_rewritten_header_without_its_checksum_is_caught(tmp_path: Path) -> None:
    store, path, _ = written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"float32"', b'"float16"', 1))  # same length, new dtype
    assert store.get("k") is None and store.corrupt == 1


def test_a_corrupt_chunk_is_never_handed_on(tmp_path: Path) -> None:
    """Chunks are checked on the reader before their bytes go anywhere: a flipped one never reaches
    the sink, and the load fails as a whole."""
    store, path, _ = written(tmp_path)
    data = bytearray(path.read_bytes())
    header = kvfile.parse_header(bytes(data))
    data[header.data_offset + 2 * ALIGN + 5] ^= 0x40  # chunk 2
    path.write_bytes(bytes(data))
    seen: list[int] = []
    with pytest.raises(kvfile.CorruptFile, match="chunk 2"):
        store.reader.read(str(path), lambda h: lambda start, buf: seen.append(start))
    assert 2 * ALIGN not in seen and len(seen) == len(header.chunks()) - 1


def test_chunks_larger_than_the_reader_takes_read_as_corrupt(tmp_path: Path) -> None:
    big = DiskTier(tmp_path, chunk_bytes=8192)
    big.put("k", random_tensor((1, 2, 300, 2, 8), torch.float32, 1))
    small = DiskTier(tmp_path, chunk_bytes=4096)
    assert small.get("k") is None and small.corrupt == 1


# --- O_DIRECT and its fallback --------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_open_refusing_o_direct_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _, packed = written(tmp_path)
    real_open = os.open

    def no_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(kvfile.os, "open", no_direct)
    got = store.get("k")
    assert got is not None and torch.equal(got[0], packed)
    assert not store.reader.direct and store.reader.fallbacks == 1
    got = store.get("k")  # later reads go buffered at once
    assert got is not None and torch.equal(got[0], packed) and store.reader.fallbacks == 1


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_read_refusing_o_direct_is_redone_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some filesystems accept O_DIRECT at open and refuse the read (EINVAL): redone buffered."""
    store, _, packed = written(tmp_path)
    real_preadv = os.preadv
    refused = []

    def picky_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(kvfile.os, "preadv", picky_preadv)
    got = store.get("k")
    assert refused and got is not None and torch.equal(got[0], packed)
    assert not store.reader.direct and store.corrupt == 0


def fcntl_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_aligned_buffers_are_aligned() -> None:
    for n in (1, 4096, 10_000):
        assert aligned_bytes(n, pin=False).data_ptr() % ALIGN == 0


# --- single flight --------------------------------------------------------------------------------


def test_single_flight_runs_a_load_once_for_overlapping_callers() -> None:
    flights: SingleFlight[int] = SingleFlight()
    calls, gate = [], threading.Event()

    def load() -> int:
        calls.append(1)
        gate.wait(5)
        return 42

    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(flights.run("k", load))) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while flights.shared < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join()
    assert calls == [1] and results == [42] * 6 and flights.shared == 5
    assert not flights.in_flight("k") and flights.run("k", lambda: 7) == 7  # nothing kept after


def test_single_flight_failure_reaches_every_waiter() -> None:
    flights: SingleFlight[int] = SingleFlight()
    gate = threading.Event()

    def load() -> int:
        gate.wait(5)
        raise OSError("disk gone")

    errors: list[BaseException] = []

    def call() -> None:
        try:
            flights.run("k", load)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    while flights.shared < 3:
        time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join()
    assert len(errors) == 4 and len({id(e) for e in errors}) == 1


def test_concurrent_disk_gets_read_the_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, _, packed = written(tmp_path)
    real = store._load
    started = threading.Event()

    def slow_load(*args: object) -> object:
        started.set()
        time.sleep(0.2)  # the others arrive while this read runs
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_load", slow_load)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(store.get("k"))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.reads == 1 and len(got) == 5
    assert all(g is not None and torch.equal(g[0], packed) for g in got)  # type: ignore[index]


def test_concurrent_gets_of_a_corrupt_file_all_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, path, _ = written(tmp_path)
    data = bytearray(path.read_bytes())
    data[kvfile.parse_header(bytes(data)).data_offset] ^= 1
    path.write_bytes(bytes(data))
    real = store._load

    def slow_load(*args: object) -> object:
        time.sleep(0.2)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_load", slow_load)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(store.get("k"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [None] * 4 and store.corrupt == 1


# --- host tier: pending copies, copy runs ---------------------------------------------------------


class FakeEvent:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_host_tier_waits_for_a_pending_copy_once_and_only_when_read() -> None:
    host = HostTier(1 << 20, pin=False)
    ready = FakeEvent()
    buf = torch.arange(48, dtype=torch.float32).view(2, 1, 2, 3, 4)
    host.put("a", buf[0], ready=ready)
    host.put("b", buf[1], ready=ready)
    assert ready.waits == 0  # putting does not wait
    got = host.get("a")
    assert got is not None and torch.equal(got[0], buf[0]) and ready.waits == 1
    host.get("a")
    assert ready.waits == 1  # landed once, not waited again
    host.pop("b")
    assert ready.waits == 2


def test_copy_runs_join_blocks_evicted_together() -> None:
    one = torch.zeros(4, 2, 3)
    two = torch.zeros(3, 2, 3)
    parts = [one[1], one[2], one[3], two[0], one[0], two[2], two[1]]
    runs = _runs(parts)
    assert [(start, run.shape[0]) for start, run in runs] == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert runs[0][1].data_ptr() == one[1].data_ptr()
    stacked = copy_stream("cpu").to_device_blocks(parts)
    assert torch.equal(stacked, torch.stack(parts))


# --- on a GPU: the copy stream's paths --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_copy_paths_are_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    """Host (pinned and pageable), disk and block-major spill round trips through the copy stream,
    with no explicit sync between the copies and the reads: events order them."""
    config = ModelConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    kv = KVCache(config, 64, 16, dtype, torch.device("cuda"))
    kv.tensor.copy_(random_tensor(tuple(kv.tensor.shape), dtype, 5).cuda())
    ref = kv.gather_rows(list(range(4)), 60)
    packed, ready = kv.gather_rows_async(list(range(4)), 60)
    host = HostTier(1 << 30)
    host.put("a", packed, ready=ready)
    kv.scatter_rows([10, 11, 12, 13], host.get("a")[0])  # type: ignore[index]
    assert torch.equal(bits(kv.gather_rows([10, 11, 12, 13], 60)), bits(ref))
    kv.scatter_rows([20, 21, 22, 23], ref.clone())  # pageable: through the pinned slots
    assert torch.equal(bits(kv.gather_rows([20, 21, 22, 23], 60)), bits(ref))
    store = DiskTier(tmp_path, readers=3, chunk_bytes=4096)
    store.put("k", ref)
    got = store.get("k", kv.tensor.device)
    assert got is not None and got[0].is_cuda
    kv.scatter_rows([30, 31, 32, 33], got[0])
    assert torch.equal(bits(kv.gather_rows([30, 31, 32, 33], 60)), bits(ref))
    blocks, ready = kv.gather_blocks([5, 9, 2])
    parts = [blocks[0], blocks[1], blocks[2]]  # one run: one copy back
    stacked = copy_stream(kv.tensor.device).to_device_blocks(parts)
    rows = stacked.permute(1, 2, 0, 3, 4, 5).reshape(4, 2, 48, 2, 64)
    kv.scatter_rows([40, 41, 42], rows)
    for i, b in enumerate([5, 9, 2]):
        assert torch.equal(bits(kv.tensor[:, :, 40 + i]), bits(kv.tensor[:, :, b]))
