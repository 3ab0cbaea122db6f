"""Host and disk tiers for KV kept off the GPU, and the copies between KVCache blocks and a packed tensor.

An entry is a ``PackedKV``: the KV rows of one entry (a prompt module, or a run of evicted prefix blocks)
in all layers, packed without padding, ``[layers, 2, rows, kv_heads, head_dim]``. Packing drops the
block layout, so an entry can come back into any free blocks of the pool, and a partly filled last
block costs no bytes in host memory or on disk.

- ``KVCache.gather_rows`` / ``KVCache.scatter_rows`` (in ``kv/cache.py``) copy between cache blocks and
  a packed host tensor.
- ``HostTier``: LRU of packed entries in host memory (pinned when CUDA is available) under a byte budget;
  ``put`` returns what it evicts, so the caller can spill it to disk.
- ``DiskTier``: one safetensors file per entry, written atomically and checksummed. A corrupt or truncated
  file is reported as a miss (and deleted) so the caller recomputes it; it is never served.

Pure kv-layer code: torch, safetensors and the standard library.
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

from prefixserve.kv.cache import PackedKV

log = logging.getLogger(__name__)

Meta = dict[str, str]


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
