"""Host and disk tiers for KV kept off the GPU, and the copies between KVCache blocks and a packed tensor.

An entry is a ``PackedKV``: the KV rows of one entry (a prompt module, or a run of evicted prefix blocks)
in all layers, packed without padding, ``[layers, 2, rows, kv_heads, head_dim]``. Packing drops the
block layout, so an entry can come back into any free blocks of the pool, and a partly filled last
block costs no bytes in host memory or on disk.

- ``gather_rows`` / ``scatter_rows``: GPU (or CPU) cache blocks <-> packed host tensor.
- ``HostTier``: LRU of packed entries in host memory (pinned when CUDA is available) under a byte budget;
  ``put`` returns what it evicts, so the caller can spill it to disk.
- ``DiskTier``: one safetensors file per entry, written atomically and checksummed. A corrupt or truncated
  file is reported as a miss (and deleted) so the caller recomputes it; it is never served.

Pure kv-layer code: torch, safetensors and the standard library, plus ``KVCache`` for its layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefixserve.kv.cache import KVCache

log = logging.getLogger(__name__)

# [layers, 2, rows, kv_heads, head_dim]: the KV rows of one entry, packed (no padding)
PackedKV = torch.Tensor

Meta = dict[str, str]


# ---------------------------------------------------------------------------------------------------------
# KVCache blocks <-> packed rows


def _slots(cache: KVCache, blocks: list[int], rows: int) -> torch.Tensor:
    """Slot ids (block * block_size + offset) of the first ``rows`` rows of ``blocks``, on the cache's device.

    Checked on the host: on CUDA an out-of-range index is a device-side assert that kills the process.
    """
    bs = cache.block_size
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    needed = -(-rows // bs)
    if len(blocks) != needed:
        raise ValueError(f"{rows} rows need {needed} blocks of {bs}, got {len(blocks)}")
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"blocks are not distinct: {blocks}")
    bad = [b for b in blocks if not 0 <= b < cache.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} outside the pool's 0..{cache.num_blocks - 1}")
    base = torch.tensor(blocks, dtype=torch.long) * bs
    slots = (base[:, None] + torch.arange(bs, dtype=torch.long)).reshape(-1)[:rows]
    if cache.tensor.device.type == "cuda":  # no blocking copy: the host may be ahead of the GPU
        slots = slots.pin_memory().to(cache.tensor.device, non_blocking=True)
    return slots


def _flat_view(cache: KVCache) -> torch.Tensor:
    """The cache as ``[layers, 2, all slots, kv_heads, head_dim]`` (a view: writes reach the cache)."""
    layers, two, nb, bs, heads, dim = cache.tensor.shape
    return cache.tensor.view(layers, two, nb * bs, heads, dim)


def gather_rows(cache: KVCache, blocks: list[int], rows: int) -> PackedKV:
    """Copy the first ``rows`` KV rows held in ``blocks`` (in order) of every layer to a new host tensor.

    ``blocks`` are exactly the ``ceil(rows / block_size)`` blocks that hold the rows, in order; the last may
    be partly filled (its rows past ``rows`` are not copied). Returns a contiguous CPU tensor
    ``[layers, 2, rows, kv_heads, head_dim]`` of the cache's dtype.

    On CUDA: one gather kernel on the current stream into a device temporary of exactly ``rows`` rows, then a
    non_blocking D2H copy into pinned memory on the same stream, then ``current_stream().synchronize()``
    before returning. So the result is complete when this returns (correctness first; no event to carry),
    and it sees every write to those blocks that was enqueued on the current stream before the call. The
    price is a host wait for the work already queued on that stream: call it where the host would wait
    anyway (e.g. after a step's outputs are read), or from a side stream if that wait ever shows.
    Measured on an H100 (512 MiB, 4096 bf16 rows of an 8B-shaped model): 11 ms (48 GB/s) once PyTorch's
    caching host allocator holds a pinned block of that size; the first pinned allocation costs ~0.4 s.
    """
    slots = _slots(cache, blocks, rows)
    packed = _flat_view(cache).index_select(2, slots)  # contiguous, exactly `rows` rows
    if cache.tensor.device.type != "cuda":
        return packed  # index_select made a new tensor: nothing shares the cache's memory
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    torch.cuda.current_stream(cache.tensor.device).synchronize()
    return host


def scatter_rows(cache: KVCache, blocks: list[int], packed: PackedKV) -> None:
    """Write ``packed`` rows into ``blocks``, in order: the inverse of ``gather_rows``.

    ``packed`` is ``[layers, 2, rows, kv_heads, head_dim]`` of the cache's dtype; ``blocks`` are
    ``ceil(rows / block_size)`` distinct pool blocks. Only the ``rows`` slots are written: the rest of a
    partly filled last block, and every other block, are untouched.

    On CUDA: a non_blocking H2D copy on the current stream (truly asynchronous when ``packed`` is pinned, as
    ``HostTier`` entries and ``gather_rows`` results are), then one scatter kernel on the same stream. It
    returns without waiting: kernels enqueued later on the current stream see the data, and the host can
    go on (the copy overlaps host work). Do not modify ``packed`` in place until that stream has passed the
    copy (dropping the reference is fine: the caching host allocator keeps pinned memory until the copy is
    done). Work on another stream must wait for the current stream first.
    """
    layers, two, _, _, heads, dim = cache.tensor.shape
    shape = tuple(packed.shape)
    if len(shape) != 5 or shape[:2] + shape[3:] != (layers, two, heads, dim):
        raise ValueError(
            f"packed shape {shape} does not fit the cache: want ({layers}, {two}, rows, {heads}, {dim})"
        )
    if packed.dtype != cache.tensor.dtype:
        raise ValueError(f"packed dtype {packed.dtype} != cache dtype {cache.tensor.dtype}")
    slots = _slots(cache, blocks, packed.shape[2])
    src = packed.to(cache.tensor.device, non_blocking=True)
    _flat_view(cache).index_copy_(2, slots, src)


def packed_nbytes(packed: PackedKV) -> int:
    """Bytes of a packed entry's data (what the host tier's budget counts)."""
    return packed.numel() * packed.element_size()


# ---------------------------------------------------------------------------------------------------------
# Host tier


class HostTier:
    """LRU of packed entries in host memory under a byte budget.

    The budget counts tensor bytes only (``packed_nbytes``). ``put`` returns the entries it pushed out, least
    recently used first, so the caller can spill them to disk; the tier itself never writes anywhere. An
    entry bigger than the whole budget is not kept: it comes back as evicted at once.

    Entries are CPU tensors; with ``pin`` (default: whenever CUDA is available) a pageable tensor is copied
    into pinned memory on ``put``, so ``scatter_rows`` from it is a truly asynchronous H2D copy. A tensor
    already pinned (``gather_rows`` on CUDA returns one) is kept as it is, without a copy. The tier holds
    references, not copies: the caller must not modify a tensor after ``put`` or after ``get`` hands it out.
    """

    def __init__(self, capacity_bytes: int, pin: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[PackedKV, Meta]] = OrderedDict()  # oldest first

    def put(self, key: str, packed: PackedKV, meta: Meta | None = None) -> list[tuple[str, PackedKV, Meta]]:
        """Keep ``packed`` under ``key`` as the most recently used entry (replacing an older one of that key).

        Returns the evicted ``(key, packed, meta)``, least recently used first: the entries pushed out to make
        room, or this one alone if it is bigger than the whole budget (then an older entry of the key is
        dropped too, since it is stale).
        """
        if packed.device.type != "cpu":
            raise ValueError(f"HostTier keeps CPU tensors, got one on {packed.device}")
        meta = dict(meta or {})
        self.pop(key)
        size = packed_nbytes(packed)
        if size > self.capacity_bytes:
            return [(key, packed, meta)]
        evicted: list[tuple[str, PackedKV, Meta]] = []
        while self.nbytes + size > self.capacity_bytes:
            old_key, (old_packed, old_meta) = self._entries.popitem(last=False)
            self.nbytes -= packed_nbytes(old_packed)
            evicted.append((old_key, old_packed, old_meta))
        if self.pin and not packed.is_pinned():
            packed = packed.pin_memory()
        self._entries[key] = (packed, meta)
        self.nbytes += size
        return evicted

    def get(self, key: str) -> tuple[PackedKV, Meta] | None:
        """The entry and its metadata (a copy of the dict), marked most recently used; None if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0], dict(entry[1])

    def pop(self, key: str) -> tuple[PackedKV, Meta] | None:
        """Remove and return the entry (e.g. when it moves to the GPU or is invalidated); None if absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= packed_nbytes(entry[0])
        return entry

    def keys(self) -> list[str]:
        """Keys from least to most recently used (the eviction order)."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        """Membership only: does not change recency."""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------------------------------
# Disk tier

_KEY = re.compile(r"[A-Za-z0-9_.-]+")
_SUFFIX = ".safetensors"
_TMP_SUFFIX = ".tmp"
_MAX_KEY = 200  # file names stop at 255 bytes on common filesystems; leave room for the suffixes
_FIELD = "prefixserve."  # our fields in the safetensors metadata: sha256, dtype, shape, meta


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _checksum(tensor: torch.Tensor, dtype: str, shape: list[int], meta: Meta) -> str:
    """sha256 of the tensor's bytes, then of its dtype, shape and metadata.

    Covering the header fields too means a flipped byte in the stored metadata is caught like one in the
    data (a flip in the safetensors dtype that keeps the element size, F32 -> I32, leaves the bytes alike
    but changes the dtype: the dtype check catches it).
    """
    h = hashlib.sha256()
    flat = tensor.contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    h.update(b"\0")
    h.update(json.dumps({"dtype": dtype, "shape": shape, "meta": meta}, sort_keys=True).encode())
    return h.hexdigest()


class DiskTier:
    """Entries as files under a directory (``--module-store DIR``): ``<key>.safetensors`` per key.

    Each file holds tensor ``kv`` and, in the safetensors metadata, the caller's metadata (JSON), the dtype,
    the shape and a sha256 over the tensor bytes and those fields. Writes go to a temp file in the same
    directory, are fsynced and then renamed over the real name (``os.replace``, atomic): a kill at any point
    leaves either the old entry, the new one or no entry under the real name, plus at worst a stale
    ``*.tmp`` file, which ``keys`` ignores. Reads check everything: a missing file is a plain miss; a
    truncated, unreadable or mismatching file is logged, deleted, counted in ``corrupt`` and reported as a
    miss, so the caller recomputes it. Wrong data is never returned.

    Keys must be file-name safe (``[A-Za-z0-9_.-]+``, at most 200 characters); the caller hashes or
    escapes anything else. Several processes may share a directory: each write is atomic, and last
    writer wins.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.corrupt = 0  # entries found corrupt (and deleted) by get

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key) or len(key) > _MAX_KEY:
            raise ValueError(f"bad store key {key!r}: want 1-{_MAX_KEY} characters of [A-Za-z0-9_.-]")
        return self.root / (key + _SUFFIX)

    def put(self, key: str, packed: PackedKV, meta: Meta | None = None) -> None:
        """Write the entry atomically (temp file, fsync, rename), replacing any older one of the key."""
        path = self._path(key)
        meta = dict(meta or {})
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"metadata must map str to str, got {k!r}: {v!r}")
        tensor = packed.detach().to("cpu").contiguous()
        dtype, shape = _dtype_name(tensor.dtype), list(tensor.shape)
        fields = {
            _FIELD + "sha256": _checksum(tensor, dtype, shape, meta),
            _FIELD + "dtype": dtype,
            _FIELD + "shape": json.dumps(shape),
            _FIELD + "meta": json.dumps(meta, sort_keys=True),
        }
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=path.name + ".", suffix=_TMP_SUFFIX)
        os.close(fd)
        try:
            save_file({"kv": tensor}, tmp, metadata=fields)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        """Make the rename itself durable (best effort: not every platform can fsync a directory)."""
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def get(self, key: str, device: str | torch.device = "cpu") -> tuple[PackedKV, Meta] | None:
        """The entry and its metadata, verified, on ``device``; None if missing or corrupt (then deleted)."""
        path = self._path(key)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                fields = f.metadata() or {}
                names = list(f.keys())
                if names != ["kv"]:
                    return self._corrupt(key, path, f"tensors {names}, want ['kv']")
                tensor = f.get_tensor("kv")
        except FileNotFoundError:
            return None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # safetensors' errors, and a Rust panic (a BaseException)
            if not path.exists():
                return None  # removed between open and read: a miss, not a corruption
            return self._corrupt(key, path, f"unreadable ({type(exc).__name__}: {exc})")
        try:
            want_sum = fields[_FIELD + "sha256"]
            want_dtype = fields[_FIELD + "dtype"]
            want_shape = json.loads(fields[_FIELD + "shape"])
            meta = json.loads(fields[_FIELD + "meta"])
        except (KeyError, ValueError) as exc:
            return self._corrupt(key, path, f"bad metadata ({type(exc).__name__}: {exc})")
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            return self._corrupt(key, path, "bad metadata (not a str -> str map)")
        dtype, shape = _dtype_name(tensor.dtype), list(tensor.shape)
        if dtype != want_dtype:
            return self._corrupt(key, path, f"dtype {dtype}, stored as {want_dtype}")
        if shape != want_shape:
            return self._corrupt(key, path, f"shape {shape}, stored as {want_shape}")
        if _checksum(tensor, dtype, shape, meta) != want_sum:
            return self._corrupt(key, path, "checksum mismatch")
        return tensor.to(device), meta

    def _corrupt(self, key: str, path: Path, problem: str) -> None:
        log.warning(
            "KV store %s: entry %r is corrupt (%s); deleted, to be recomputed", self.root, key, problem
        )
        self.corrupt += 1
        path.unlink(missing_ok=True)
        return None

    def remove(self, key: str) -> bool:
        """Delete the entry; True if there was one."""
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def keys(self) -> list[str]:
        """Keys of the entries present (sorted; not verified: ``get`` does that). Temp files are ignored."""
        return sorted(
            p.name[: -len(_SUFFIX)]
            for p in self.root.iterdir()
            if p.name.endswith(_SUFFIX) and _KEY.fullmatch(p.name[: -len(_SUFFIX)]) and p.is_file()
        )

    def __contains__(self, key: object) -> bool:
        """An entry file exists (not verified: ``get`` may still find it corrupt)."""
        try:
            return self._path(key).is_file()  # type: ignore[arg-type]
        except ValueError:
            return False  # a key put would refuse is never stored

    def __len__(self) -> int:
        return len(self.keys())
