"""KV tiers: cache blocks <-> packed rows, the host LRU, and the checksummed disk store (issues 32, 54)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.kv.cache import KVCache
from prefixserve.kv.kvfile import parse_header
from prefixserve.kv.tiers import DiskTier, HostGroup, HostTier, packed_nbytes
from prefixserve.model.config import ModelConfig

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
BLOCK = 4
NUM_BLOCKS = 10
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_cache(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> KVCache:
    cache = KVCache(TINY, NUM_BLOCKS, BLOCK, dtype, torch.device(device))
    gen = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen).to(dtype))
    return cache


def reference_gather(tensor: torch.Tensor, blocks: list[int], rows: int) -> torch.Tensor:
    """Plain indexing: the blocks' rows in order, concatenated, cut at `rows`."""
    parts = [tensor[:, :, b] for b in blocks]  # each [layers, 2, block, heads, dim]
    return torch.cat(parts, dim=2)[:, :, :rows] if parts else tensor[:, :, 0, :0]


def random_packed(rows: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (TINY.num_hidden_layers, 2, rows, TINY.num_key_value_heads, TINY.head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


# --- gather / scatter ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("blocks", "rows"),
    [([5, 1, 7], 10), ([5, 1, 7], 12), ([3], 1), ([9, 0, 4, 2], 13), ([], 0)],
)
def test_gather_equals_plain_indexing(dtype: torch.dtype, blocks: list[int], rows: int) -> None:
    cache = random_cache(dtype)
    before = cache.tensor.clone()
    packed = cache.gather_rows(blocks, rows)
    want = reference_gather(cache.tensor, blocks, rows)
    assert packed.shape == (TINY.num_hidden_layers, 2, rows, TINY.num_key_value_heads, TINY.head_dim)
    assert packed.dtype == dtype and packed.is_contiguous()
    assert torch.equal(packed, want)
    assert torch.equal(cache.tensor, before)  # reading changes nothing
    if rows:
        packed.add_(1)  # the result owns its memory
        assert torch.equal(cache.tensor, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_its_rows(dtype: torch.dtype) -> None:
    cache = random_cache(dtype)
    blocks, rows = [6, 2, 8], 10  # out of order, last block half filled
    packed = random_packed(rows, dtype)
    want = cache.tensor.clone()
    for i, b in enumerate(blocks):
        part = packed[:, :, i * BLOCK : (i + 1) * BLOCK]
        want[:, :, b, : part.shape[2]] = part
    cache.scatter_rows(blocks, packed)
    assert torch.equal(cache.tensor, want)  # every other block, the tail of block 8 and scratch untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_into_other_blocks(dtype: torch.dtype) -> None:
    cache = random_cache(dtype)
    src, dst, rows = [4, 0, 9], [1, 7, 3], 11
    packed = cache.gather_rows(src, rows)
    other = random_cache(dtype, seed=5)
    before = other.tensor.clone()
    other.scatter_rows(dst, packed)
    assert torch.equal(other.gather_rows(dst, rows), reference_gather(cache.tensor, src, rows))
    untouched = [b for b in range(NUM_BLOCKS + 1) if b not in dst]
    assert torch.equal(other.tensor[:, :, untouched], before[:, :, untouched])
    assert torch.equal(other.tensor[:, :, 3, rows - 2 * BLOCK :], before[:, :, 3, rows - 2 * BLOCK :])


def test_gather_scatter_refuse_bad_arguments() -> None:
    cache = random_cache(torch.float32)
    for blocks, rows in [([1, 2], 9), ([1, 2], 4), ([1, 1], 8), ([NUM_BLOCKS], 2), ([-1], 2), ([1], -1)]:
        with pytest.raises(ValueError):
            cache.gather_rows(blocks, rows)
    with pytest.raises(ValueError, match="dtype"):
        cache.scatter_rows([1], random_packed(3, torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        cache.scatter_rows([1], random_packed(3, torch.float32)[:, :, :, :1])
    with pytest.raises(ValueError, match="distinct"):
        cache.scatter_rows([2, 2], random_packed(6, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_on_cuda(dtype: torch.dtype) -> None:
    cache = random_cache(dtype, device="cuda")
    blocks, rows = [5, 1, 7], 10
    packed = cache.gather_rows(blocks, rows)
    assert packed.device.type == "cpu" and packed.is_pinned()
    assert torch.equal(packed, reference_gather(cache.tensor, blocks, rows).cpu())
    before = cache.tensor.clone()
    fresh = random_packed(rows, dtype).pin_memory()
    cache.scatter_rows([2, 8, 0], fresh)  # no explicit sync: same-stream work below must see it
    assert torch.equal(cache.gather_rows([2, 8, 0], rows), fresh)
    untouched = [b for b in range(NUM_BLOCKS + 1) if b not in (2, 8, 0)]
    assert torch.equal(cache.tensor[:, :, untouched], before[:, :, untouched])
    cache.scatter_rows([3, 4, 6], random_packed(rows, dtype))  # pageable source works too
    assert torch.equal(cache.gather_rows([3, 4, 6], rows), random_packed(rows, dtype))


# --- host tier --------------------------------------------------------------------------------------


def entry(rows: int, fill: float = 0.0) -> torch.Tensor:
    """A [1, 2, rows, 1, 4] fp32 entry: 32 bytes per row."""
    return torch.full((1, 2, rows, 1, 4), float(fill), dtype=torch.float32)


def test_host_tier_lru_order_and_budget() -> None:
    tier = HostTier(capacity_bytes=320, pin=False)  # 10 rows
    assert tier.put("a", entry(3, 1), {"m": "a"}) == []
    assert tier.put("b", entry(3, 2)) == []
    assert tier.put("c", entry(3, 3)) == []
    assert tier.keys() == ["a", "b", "c"] and len(tier) == 3 and tier.nbytes == 288
    evicted = tier.put("d", entry(3, 4))  # needs 96 bytes: "a" goes
    assert [k for k, _, _ in evicted] == ["a"]
    assert torch.equal(evicted[0][1], entry(3, 1)) and evicted[0][2] == {"m": "a"}
    assert tier.keys() == ["b", "c", "d"] and "a" not in tier and tier.nbytes == 288
    evicted = tier.put("e", entry(6, 5))  # needs 192 bytes: "b" and "c", oldest first
    assert [k for k, _, _ in evicted] == ["b", "c"]
    assert tier.keys() == ["d", "e"] and tier.nbytes == 288 <= tier.capacity_bytes


def test_host_tier_get_refreshes_recency() -> None:
    tier = HostTier(capacity_bytes=320, pin=False)
    for key in "abc":
        tier.put(key, entry(3))
    got = tier.get("a")
    assert got is not None and torch.equal(got[0], entry(3)) and got[1] == {}
    assert "b" in tier and tier.keys() == ["b", "c", "a"]  # `in` does not refresh
    assert [k for k, _, _ in tier.put("d", entry(3))] == ["b"]
    assert tier.get("b") is None


def test_host_tier_oversize_replace_and_pop() -> None:
    tier = HostTier(capacity_bytes=320, pin=False)
    tier.put("a", entry(3))
    big = entry(11)  # 352 bytes > the whole budget
    evicted = tier.put("big", big, {"x": "y"})
    assert (
        len(evicted) == 1 and evicted[0][0] == "big" and evicted[0][1] is big and evicted[0][2] == {"x": "y"}
    )
    assert "big" not in tier and tier.keys() == ["a"] and tier.nbytes == 96
    assert tier.put("a", entry(5, 7)) == []  # replacing counts the new size only
    assert tier.nbytes == packed_nbytes(entry(5)) == 160 and len(tier) == 1
    assert [k for k, _, _ in tier.put("a", entry(11))] == ["a"] and len(tier) == 0  # stale copy dropped too
    tier.put("b", entry(2))
    popped = tier.pop("b")
    assert popped is not None and tier.nbytes == 0 and tier.pop("b") is None
    with pytest.raises(ValueError):
        HostTier(-1)


def test_host_tier_counts_a_group_once_until_its_last_entry_goes() -> None:
    """Entries that are views of one allocation (Prompt Cache pieces moved out together): the budget
    counts the allocation, from its first entry in to its last entry out, when its memory is freed."""
    tier = HostTier(capacity_bytes=1000, pin=False)
    whole = torch.zeros(100)  # 400 bytes
    group = HostGroup(packed_nbytes(whole))
    for key, (a, b) in zip("abc", [(0, 30), (32, 60), (64, 100)], strict=True):
        assert tier.put(key, whole[a:b], group=group) == []
        assert tier.nbytes == 400
    tier.put("d", torch.zeros(125))  # 500 bytes: 900
    assert [k for k, _, _ in tier.put("e", torch.zeros(50))] == ["a", "b", "c"]  # 200 fit once c went
    assert tier.nbytes == 700 and group.members == 0
    again = HostGroup(400)
    tier.put("a", whole[0:30], group=again)
    tier.put("b", whole[32:60], group=again)
    assert tier.nbytes == 1100 - 500 and tier.keys() == ["e", "a", "b"]  # d made room for the group
    assert tier.pop("a") is not None and tier.nbytes == 600  # b still holds it
    assert tier.take("b") is not None and tier.nbytes == 200
    assert [k for k, _, _ in tier.put("f", whole[:10], group=HostGroup(1200))] == ["f"]  # over the budget
    assert tier.nbytes == 200 and "f" not in tier


# --- disk tier --------------------------------------------------------------------------------------


def packed_for(dtype: torch.dtype, rows: int = 5) -> torch.Tensor:
    return random_packed(rows, dtype, seed=7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_disk_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    store = DiskTier(tmp_path / "store")
    packed = packed_for(dtype)
    meta = {"schema": "trip", "module": "tokyo", "dtype": "x"}  # user keys may shadow ours: they are apart
    store.put("trip.tokyo-1_a", packed, meta)
    assert "trip.tokyo-1_a" in store and store.keys() == ["trip.tokyo-1_a"] and len(store) == 1
    got = store.get("trip.tokyo-1_a")
    assert got is not None
    assert got[0].dtype == dtype and torch.equal(got[0], packed) and got[1] == meta
    assert store.get("other") is None and store.corrupt == 0  # missing is a plain miss
    store.put("trip.tokyo-1_a", packed_for(dtype, rows=2))  # replaced
    got = store.get("trip.tokyo-1_a")
    assert got is not None and torch.equal(got[0], packed_for(dtype, rows=2)) and got[1] == {}
    assert store.remove("trip.tokyo-1_a") and not store.remove("trip.tokyo-1_a")
    assert store.keys() == [] and "trip.tokyo-1_a" not in store
    assert not [p for p in (tmp_path / "store").iterdir()]  # no temp file left behind


def only_file(store: DiskTier) -> Path:
    (path,) = store.root.iterdir()
    return path


def test_disk_flipped_data_byte_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskTier(tmp_path)
    store.put("k", packed_for(torch.float32))
    path = only_file(store)
    data = bytearray(path.read_bytes())
    data[parse_header(bytes(data)).data_offset + 3] ^= 0x01  # a byte of the tensor data
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="prefixserve.kv.tiers"):
        assert store.get("k") is None
    assert store.corrupt == 1 and not path.exists() and "k" not in store
    assert "'k'" in caplog.text and "checksum" in caplog.text
    assert store.get("k") is None and store.corrupt == 1  # now simply missing


@pytest.mark.parametrize("keep", [0, 5, 8, 40, 4096, 4097, -1, -4096, "extended"])
def test_disk_truncated_file_is_a_miss(tmp_path: Path, keep: int | str) -> None:
    store = DiskTier(tmp_path, chunk_bytes=4096)
    store.put("k", packed_for(torch.bfloat16, rows=200))  # 4800 bytes: two chunks
    path = only_file(store)
    data = path.read_bytes()
    path.write_bytes(data + bytes(4096) if keep == "extended" else data[:keep])
    assert store.get("k") is None
    assert store.corrupt == 1 and not path.exists()


def test_disk_garbage_file_is_a_miss(tmp_path: Path) -> None:
    store = DiskTier(tmp_path)
    (tmp_path / "junk.kv").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all" * 3)
    assert store.keys() == ["junk"]
    assert store.get("junk") is None and store.corrupt == 1 and store.keys() == []


def test_disk_older_safetensors_entry_is_a_plain_miss(tmp_path: Path) -> None:
    """The earlier format is not read: a miss (recomputed and written anew), the old file left alone."""
    from safetensors.torch import save_file

    store = DiskTier(tmp_path)
    save_file({"kv": packed_for(torch.float32)}, str(tmp_path / "old.safetensors"))
    assert store.get("old") is None and store.corrupt == 0 and store.keys() == [] and "old" not in store
    assert (tmp_path / "old.safetensors").exists()


def test_disk_stale_temp_file_is_ignored(tmp_path: Path) -> None:
    store = DiskTier(tmp_path)
    store.put("a", packed_for(torch.float32))
    (tmp_path / "b.kv.x1y2z3.tmp").write_bytes(b"half written")  # a writer killed mid-put
    assert store.keys() == ["a"] and "b" not in store and store.get("b") is None and store.corrupt == 0
    got = store.get("a")
    assert got is not None and torch.equal(got[0], packed_for(torch.float32))


@pytest.mark.parametrize("key", ["", "a/b", "../x", "a b", "ü", "x" * 201, "a\0b"])
def test_disk_bad_key_refused(tmp_path: Path, key: str) -> None:
    store = DiskTier(tmp_path)
    with pytest.raises(ValueError, match="key"):
        store.put(key, packed_for(torch.float32))
    with pytest.raises(ValueError, match="key"):
        store.get(key)
    assert key not in store
    assert list(tmp_path.iterdir()) == []


def test_disk_bad_meta_refused(tmp_path: Path) -> None:
    store = DiskTier(tmp_path)
    with pytest.raises(ValueError, match="metadata"):
        store.put("k", packed_for(torch.float32), {"n": 3})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


# One small entry per dtype, written once; each example flips one byte of a copy.
_ORIGINALS: dict[torch.dtype, tuple[bytes, torch.Tensor, dict[str, str]]] = {}


def original_file(dtype: torch.dtype) -> tuple[bytes, torch.Tensor, dict[str, str]]:
    if dtype not in _ORIGINALS:
        packed, meta = random_packed(90, dtype, seed=3), {"schema": "s", "module": "m"}  # 2 chunks (fp32)
        with tempfile.TemporaryDirectory() as d:
            store = DiskTier(d, chunk_bytes=4096)
            store.put("k", packed, meta)
            _ORIGINALS[dtype] = ((Path(d) / "k.kv").read_bytes(), packed, meta)
    return _ORIGINALS[dtype]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), where=st.data(), mask=st.integers(1, 255))
def test_disk_flipped_byte_never_serves_wrong_data(
    dtype: torch.dtype, where: st.DataObject, mask: int
) -> None:
    data, packed, meta = original_file(dtype)
    corrupted = bytearray(data)
    corrupted[where.draw(st.integers(0, len(data) - 1), label="position")] ^= mask
    with tempfile.TemporaryDirectory() as d:
        store = DiskTier(d, chunk_bytes=4096)
        (Path(d) / "k.kv").write_bytes(bytes(corrupted))
        got = store.get("k")
        if got is None:
            assert store.corrupt == 1 and store.keys() == []
        else:  # a harmless flip (padding after the header or the data): exactly the original
            assert got[0].dtype == packed.dtype and got[0].shape == packed.shape
            assert torch.equal(got[0].view(torch.uint8), packed.view(torch.uint8)) and got[1] == meta
