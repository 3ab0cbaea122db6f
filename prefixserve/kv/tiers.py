"""Host and disk tiers for KV kept off the GPU, and the copies between KVCache blocks and a packed tensor.

An entry is a ``PackedKV``: the KV rows of one entry (a prompt module, or a run of evicted prefix blocks)
in all layers, packed without padding, ``[layers, 2, rows, kv_heads, head_dim]``. Packing drops the
block layout, so an entry can come back into any free blocks of the pool, and a partly filled last
block costs no bytes in host memory or on disk.

- ``KVCache.gather_rows`` / ``KVCache.scatter_rows`` (in ``kv/cache.py``) copy between cache blocks and
  a packed host tensor.
- ``HostTier``: LRU of packed entries in host memory (pinned when CUDA is available) under a byte budget;
  ``put`` returns what it evicts, so the caller can spill it to disk. An entry may still be on its way
  from the device (a copy on the copy stream): it carries that copy's event, and ``get`` waits on it.
- ``DiskTier``: one file per entry (``kv/kvfile.py``: raw bytes in xxh3-checked chunks), written
  atomically, read with O_DIRECT by several threads into pinned buffers, each chunk verified and then
  copied to the device while the next ones are read (``kv/transfer.py``). A corrupt or truncated file is
  reported as a miss (and deleted) so the caller recomputes it; it is never served. Concurrent reads of
  one key share one load (``kv/single_flight.py``).

Pure kv-layer code: torch, xxhash and the standard library.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from prefixserve.kv import kvfile
from prefixserve.kv.cache import PackedKV
from prefixserve.kv.single_flight import SingleFlight
from prefixserve.kv.transfer import Ready, copy_stream

log = logging.getLogger(__name__)

Meta = dict[str, str]


def packed_nbytes(packed: PackedKV) -> int:
    """Bytes of a packed entry's data (what the host tier's budget counts)."""
    return packed.numel() * packed.element_size()


# ---------------------------------------------------------------------------------------------------------
# Host tier


class HostGroup:
    """One host allocation that several entries are views of (Prompt Cache pieces moved out together):
    the budget counts its bytes once, from its first entry in until its last entry out, since its
    memory is freed only then (an entry that stays keeps its neighbours' bytes held)."""

    __slots__ = ("members", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.members = nbytes, 0


class _HostEntry:
    __slots__ = ("group", "meta", "packed", "ready")

    def __init__(
        self, packed: PackedKV, meta: Meta, ready: Ready | None, group: HostGroup | None = None
    ) -> None:
        self.packed, self.meta, self.ready, self.group = packed, meta, ready, group

    def landed(self) -> PackedKV:
        """The tensor, once the copy that fills it (if any) has finished: it may be read on the host."""
        if self.ready is not None:
            self.ready.synchronize()  # that copy alone, long done by the time an entry is read again
            self.ready = None
        return self.packed


class HostTier:
    """LRU of packed entries in host memory under a byte budget.

    The budget counts tensor bytes only (``packed_nbytes``; for the entries of a ``HostGroup``, the group's
    bytes, once). ``put`` returns the entries it pushed out, least recently used first, so the caller can
    spill them to disk; the tier itself never writes anywhere. An entry (or group) bigger than the whole
    budget is not kept: it comes back as evicted at once.

    Entries are CPU tensors; with ``pin`` (default: whenever CUDA is available) a pageable tensor is copied
    into pinned memory on ``put``, so a copy to the device from it is truly asynchronous. A tensor already
    pinned (``gather_rows`` on CUDA returns one) is kept as it is, without a copy; so is a view of a larger
    pinned tensor (a slot of the prefix spill's slabs; Prompt Cache pieces moved out together, one
    ``HostGroup``, whose buffer is freed when the last of them goes and counted until then). ``ready``: the
    event of the device-to-host copy still filling ``packed``; ``get`` and eviction wait for it, so what
    they hand out is whole. The tier holds references, not copies: the caller must not modify a tensor
    after ``put`` or after ``get`` hands it out.
    """

    def __init__(self, capacity_bytes: int, pin: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.nbytes = 0
        self._entries: OrderedDict[str, _HostEntry] = OrderedDict()  # oldest first
        # called with (key, ready) for each entry the tier drops on its own (pushed out, or replaced
        # by a ``put`` of its key), so the owner of its memory can reuse it (kv/prefix_spill.py)
        self.on_drop: Callable[[str, Ready | None], None] | None = None

    def put(
        self,
        key: str,
        packed: PackedKV,
        meta: Meta | None = None,
        ready: Ready | None = None,
        group: HostGroup | None = None,
    ) -> list[tuple[str, PackedKV, Meta]]:
        """Keep ``packed`` under ``key`` as the most recently used entry (replacing an older one of that key).

        Returns the evicted ``(key, packed, meta)``, least recently used first: the entries pushed out to make
        room, or this one alone if it (or its group) is bigger than the whole budget (then an older entry
        of the key is dropped too, since it is stale). ``group``: the allocation ``packed`` is a view of,
        shared with other entries, whose bytes the budget counts instead of the view's.
        """
        if packed.device.type != "cpu":
            raise ValueError(f"HostTier keeps CPU tensors, got one on {packed.device}")
        meta = dict(meta or {})
        stale = self._entries.pop(key, None)
        if stale is not None:
            self._uncharge(stale)
            self._dropped(key, stale)
        repin = self.pin and not packed.is_pinned()
        if repin:
            group = None  # copied into pinned memory of its own below
        if (group.nbytes if group is not None else packed_nbytes(packed)) > self.capacity_bytes:
            return [(key, _HostEntry(packed, meta, ready).landed(), meta)]
        evicted = self.make_room(
            packed_nbytes(packed) if group is None else 0 if group.members else group.nbytes
        )
        if repin:
            if ready is not None:
                ready.synchronize()
                ready = None
            packed = packed.pin_memory()
        entry = self._entries[key] = _HostEntry(packed, meta, ready, group)
        self._charge(entry)
        return evicted

    def _charge(self, entry: _HostEntry) -> None:
        group = entry.group
        if group is None:
            self.nbytes += packed_nbytes(entry.packed)
            return
        if not group.members:
            self.nbytes += group.nbytes
        group.members += 1

    def _uncharge(self, entry: _HostEntry) -> None:
        group = entry.group
        if group is None:
            self.nbytes -= packed_nbytes(entry.packed)
            return
        group.members -= 1
        if not group.members:
            self.nbytes -= group.nbytes

    def make_room(self, nbytes: int, wait: bool = True) -> list[tuple[str, PackedKV, Meta]]:
        """Push out least recently used entries until ``nbytes`` more fit (all of them if they never
        will); returns them as ``put`` does. ``wait=False``: for a caller that drops them, do not wait
        for copies still filling them (their tensors may then be incomplete)."""
        evicted: list[tuple[str, PackedKV, Meta]] = []
        while self._entries and self.nbytes + nbytes > self.capacity_bytes:
            old_key, old = self._entries.popitem(last=False)
            self._uncharge(old)
            evicted.append((old_key, old.landed() if wait else old.packed, old.meta))
            self._dropped(old_key, old)
        return evicted

    def _dropped(self, key: str, entry: _HostEntry) -> None:
        if self.on_drop is not None:
            self.on_drop(key, entry.ready)

    def take(self, key: str) -> tuple[PackedKV, Ready | None] | None:
        """Remove the entry and return its tensor with the event of the copy still filling it (None
        if done), without waiting: for a caller whose next copy of it is ordered after that one
        anyway (on the same copy stream). None if absent. Recency of other entries is unchanged."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._uncharge(entry)
        return entry.packed, entry.ready

    def get(self, key: str) -> tuple[PackedKV, Meta] | None:
        """The entry and its metadata (a copy of the dict), marked most recently used; None if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.landed(), dict(entry.meta)

    def pop(self, key: str) -> tuple[PackedKV, Meta] | None:
        """Remove and return the entry (e.g. when it moves to the GPU or is invalidated); None if absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._uncharge(entry)
        return entry.landed(), entry.meta

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
_SUFFIX = ".kv"  # kv/kvfile.py's format; the older ``.safetensors`` entries are not read (a miss)
_TMP_SUFFIX = ".tmp"
_MAX_KEY = 200  # file names stop at 255 bytes on common filesystems; leave room for the suffixes


class DiskTier:
    """Entries as files under a directory (``--module-store DIR``): ``<key>.kv`` per key (``kv/kvfile.py``).

    Writes go to a temp file in the same directory, are fsynced and then renamed over the real name
    (``os.replace``, atomic): a kill at any point leaves either the old entry, the new one or no entry
    under the real name, plus at worst a stale ``*.tmp`` file, which ``keys`` ignores. Reads check
    everything: a missing file is a plain miss; a truncated, unreadable or mismatching file is logged,
    deleted, counted in ``corrupt`` and reported as a miss, so the caller recomputes it. Wrong data is
    never returned: each chunk is checked before its bytes go anywhere, and the tensor is returned only
    once every chunk has passed.

    Files of the earlier safetensors format (``<key>.safetensors``) are left alone and not read: such an
    entry is a miss, recomputed once and written again in this format.

    ``readers`` threads read ``chunk_bytes`` chunks (the unit of checking and of the copy to the device;
    files written with larger chunks read as corrupt), with ``O_DIRECT`` unless ``direct`` is off or the
    filesystem refuses it (then buffered). Keys must be file-name safe (``[A-Za-z0-9_.-]+``, at most 200
    characters); the caller hashes or escapes anything else. Several processes may share a directory:
    each write is atomic, and last writer wins. Concurrent ``get`` calls for one key share one read.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        readers: int = 4,
        chunk_bytes: int = 8 << 20,
        direct: bool = True,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.chunk_bytes = chunk_bytes
        self.corrupt = 0  # entries found corrupt (and deleted) by get
        self.reads = 0  # files read (a get answered by another's read is not one)
        self.read_bytes = 0
        self.read_seconds = 0.0  # wall time of those reads, until the last chunk's copy was enqueued
        self._reader = kvfile.Reader(readers, chunk_bytes, direct, pin=torch.cuda.is_available())
        self._flights: SingleFlight[tuple[PackedKV, Meta, Ready | None] | None] = SingleFlight()

    @property
    def reader(self) -> kvfile.Reader:
        return self._reader

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
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=path.name + ".", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                kvfile.write(f, tensor, meta, self.chunk_bytes)
                f.flush()
                os.fsync(f.fileno())
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
        """The entry and its metadata, verified, on ``device``; None if missing or corrupt (then deleted).

        On CUDA the tensor was copied on the device's copy stream; the current stream is made to wait
        for it (an event), so work enqueued after this call sees it and the host does not wait for the
        copies, only for the reads and checks."""
        path = self._path(key)
        dev = torch.device(device)
        found = self._flights.run((key, str(dev)), lambda: self._load(key, path, dev))
        if found is None:
            return None
        tensor, meta, ready = found
        return copy_stream(dev).hand_over(tensor, ready), dict(meta)

    def _load(self, key: str, path: Path, device: torch.device) -> tuple[PackedKV, Meta, Ready | None] | None:
        copier = copy_stream(device)
        out: dict[str, torch.Tensor] = {}

        def begin(header: kvfile.Header) -> kvfile.Sink:
            dst = copier.empty((header.nbytes,), torch.uint8)
            out["dst"] = dst
            return lambda start, data: copier.copy_in(dst[start : start + data.numel()], data)

        t0 = time.perf_counter()
        try:
            header = self._reader.read(str(path), begin)
        except FileNotFoundError:
            return None
        except (kvfile.CorruptFile, OSError) as exc:
            if not path.exists():
                return None  # removed between open and read: a miss, not a corruption
            return self._corrupt(key, path, f"{type(exc).__name__}: {exc}")
        ready = copier.record()  # after every chunk's copy
        self.reads += 1
        self.read_bytes += header.nbytes
        self.read_seconds += time.perf_counter() - t0
        tensor = out["dst"].view(header.dtype).view(header.shape)
        return tensor, header.meta, ready

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
