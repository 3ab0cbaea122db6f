"""The disk tier's file: a verified header, then the packed KV's raw bytes in xxh3-checked chunks.

Why our own format: a safetensors read is one serial pass (read, then sha256 over the whole file,
then a pageable copy to the device), about 0.9 GB/s. Here the bytes sit at 4096-aligned offsets, so
they can be read with ``O_DIRECT`` straight into aligned (pinned) buffers, by several readers at once,
and each chunk carries its own digest: a reader checks its chunk as soon as it lands and hands it on
to the device copy while the other chunks are still being read. Nothing unchecked is handed on.

Layout (integers little-endian)::

    MAGIC (8 bytes) | header length n (u32) | header (n bytes of JSON) | xxh3_128(MAGIC .. header) (16)
    zero padding to data_offset (a multiple of 4096)
    data: the tensor's bytes, row-major | zero padding to a multiple of 4096

The JSON holds dtype, shape, the caller's metadata (str -> str), chunk_bytes and one xxh3_128 hex
digest per chunk (chunk i seeded with i, so swapped chunks do not pass). The file's size must be
exactly what the header says: a truncated or extended file is corrupt. Padding is not checked: a flip
there changes nothing that is served.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import torch
import xxhash

from prefixserve.kv.transfer import ALIGN, Slot, Slots

log = logging.getLogger(__name__)

MAGIC = b"PSKV\x01\r\n\x1a"
_LEN = struct.Struct("<I")
_DIGEST = 16
_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64")
}
_DTYPES.update({n: getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)})


class CorruptFile(Exception):
    """The file is not a whole, matching entry (truncated, flipped, foreign): recompute, never serve."""


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def chunk_digest(data: memoryview | bytes, index: int) -> str:
    return xxhash.xxh3_128_hexdigest(data, seed=index)


@dataclass(frozen=True, slots=True)
class Header:
    dtype: torch.dtype
    shape: tuple[int, ...]
    meta: dict[str, str]
    chunk_bytes: int
    digests: tuple[str, ...]
    data_offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def file_size(self) -> int:
        return self.data_offset + round_up(self.nbytes)

    def chunks(self) -> list[tuple[int, int, int]]:
        """(index, start, length) of each chunk of the data (start relative to the data)."""
        step, n = self.chunk_bytes, self.nbytes
        return [(i, s, min(step, n - s)) for i, s in enumerate(range(0, n, step))]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def write(f: BinaryIO, tensor: torch.Tensor, meta: dict[str, str], chunk_bytes: int) -> None:
    """Write ``tensor`` (CPU, contiguous) and ``meta`` to ``f`` in this format."""
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
    if _dtype_name(tensor.dtype) not in _DTYPES:
        raise ValueError(f"dtype {tensor.dtype} cannot be stored")
    data = tensor_bytes(tensor)
    digests = [
        chunk_digest(data[s : s + chunk_bytes], i) for i, s in enumerate(range(0, len(data), chunk_bytes))
    ]
    fields = {
        "dtype": _dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "meta": meta,
        "chunk_bytes": chunk_bytes,
        "hash": "xxh3_128",
        "digests": digests,
    }
    body = json.dumps(fields, sort_keys=True).encode()
    head = MAGIC + _LEN.pack(len(body)) + body
    head += xxhash.xxh3_128_digest(head)
    f.write(head + bytes(round_up(len(head)) - len(head)))
    f.write(data)
    f.write(bytes(round_up(len(data)) - len(data)))


def parse_header(raw: bytes) -> Header:
    """The header at the start of ``raw`` (at least its first ``data_offset`` bytes), checked."""
    fixed = len(MAGIC) + _LEN.size
    if len(raw) < fixed or raw[: len(MAGIC)] != MAGIC:
        raise CorruptFile("not a prefixserve KV file (magic)")
    (n,) = _LEN.unpack_from(raw, len(MAGIC))
    end = fixed + n
    if len(raw) < end + _DIGEST:
        raise CorruptFile("header runs past the bytes read")
    if xxhash.xxh3_128_digest(raw[:end]) != raw[end : end + _DIGEST]:
        raise CorruptFile("header checksum mismatch")
    try:
        fields = json.loads(raw[fixed:end])
        dtype = _DTYPES[fields["dtype"]]
        shape = tuple(int(d) for d in fields["shape"])
        meta = fields["meta"]
        chunk_bytes = int(fields["chunk_bytes"])
        digests = tuple(str(d) for d in fields["digests"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptFile(f"bad header ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptFile("bad metadata (not a str -> str map)")
    if any(d < 0 for d in shape) or chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise CorruptFile(f"bad shape {shape} or chunk size {chunk_bytes}")
    header = Header(dtype, shape, meta, chunk_bytes, digests, round_up(end + _DIGEST))
    if len(digests) != len(header.chunks()):
        raise CorruptFile(f"{len(digests)} chunk digests for {len(header.chunks())} chunks")
    return header


Sink = Callable[[int, torch.Tensor], object]  # (data offset, verified bytes): enqueue their copy out


class Reader:
    """Reads files of this format with ``readers`` threads, chunks verified as they land.

    ``direct``: open with ``O_DIRECT`` (the page cache is bypassed: reads go at the drive's speed
    without evicting anything, and no copy through the kernel's pages). A filesystem that refuses it
    (``EINVAL``, e.g. tmpfs) is read buffered from then on, and the fallback is logged once.
    """

    def __init__(
        self, readers: int = 4, chunk_bytes: int = 8 << 20, direct: bool = True, pin: bool = False
    ) -> None:
        self.readers = readers
        self.chunk_bytes = chunk_bytes
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix="prefixserve-kv-read")
        self._pin = pin
        self._slots: Slots | None = None  # made at the first read: an unread store pins nothing
        self._lock = threading.Lock()
        self.fallbacks = 0  # files read buffered after O_DIRECT was refused

    @property
    def slots(self) -> Slots:
        """Twice the readers: a reader fills a slot while the device still copies out of its last one."""
        with self._lock:
            if self._slots is None:
                self._slots = Slots(2 * self.readers, self.chunk_bytes, self._pin)
            return self._slots

    def _open(self, path: str) -> tuple[int, bool]:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back(path, exc)
        return os.open(path, os.O_RDONLY), False

    def _fall_back(self, path: str, exc: OSError) -> None:
        if self.direct:
            log.info("KV store: O_DIRECT refused for %s (%s); reading buffered", path, exc)
        self.direct = False
        self.fallbacks += 1

    def read(self, path: str, begin: Callable[[Header], Sink]) -> Header:
        """Read and verify ``path``; every verified chunk goes to the sink ``begin(header)`` returns.

        The sink runs on reader threads, once per chunk, with a slot's bytes that are reused once it
        returns; it returns the event after its copy out (or None when the copy is done). Raises
        ``CorruptFile`` (some chunks may have gone to the sink: the caller drops what it has) and
        ``FileNotFoundError``."""
        fd, direct = self._open(path)
        try:
            size = os.fstat(fd).st_size
            head = self._head(fd, size, direct, path)
            header = parse_header(head)
            if size != header.file_size:
                raise CorruptFile(f"file of {size} bytes, header says {header.file_size}")
            if header.chunk_bytes > self.slots.nbytes:
                raise CorruptFile(
                    f"chunks of {header.chunk_bytes} bytes, over this reader's {self.chunk_bytes}"
                )
            sink = begin(header)
            jobs = [self.pool.submit(self._chunk, fd, header, c, sink, direct, path) for c in header.chunks()]
            errors = [e for e in (j.exception() for j in jobs) if e is not None]
            if errors:
                raise errors[0]
            return header
        finally:
            os.close(fd)

    def _head(self, fd: int, size: int, direct: bool, path: str) -> bytes:
        """The file's first ``data_offset`` bytes (one aligned read unless the header is longer)."""
        slot = self.slots.acquire()
        try:
            got = self._pread(fd, slot, ALIGN, 0, direct, path)
            head = bytes(slot.buf[:got].numpy())
        finally:
            self.slots.release(slot)
        fixed = len(MAGIC) + _LEN.size
        if got < fixed:
            raise CorruptFile(f"{got} bytes: no header")
        need = round_up(fixed + _LEN.unpack_from(head, len(MAGIC))[0] + _DIGEST)
        if need <= ALIGN:
            return head
        if need > size:
            raise CorruptFile(f"header of {need} bytes in a file of {size}")
        return _read_plain(path, need)

    def _chunk(
        self, fd: int, header: Header, chunk: tuple[int, int, int], sink: Sink, direct: bool, path: str
    ) -> None:
        index, start, length = chunk
        slot = self.slots.acquire()
        ready = None
        try:
            got = self._pread(fd, slot, round_up(length), header.data_offset + start, direct, path)
            if got < length:
                raise CorruptFile(f"chunk {index}: {got} of {length} bytes")
            data = slot.buf[:length]
            if chunk_digest(memoryview(data.numpy()), index) != header.digests[index]:
                raise CorruptFile(f"chunk {index} checksum mismatch")
            ready = sink(start, data)
        finally:
            self.slots.release(slot, ready)  # type: ignore[arg-type]

    def _pread(self, fd: int, slot: Slot, length: int, offset: int, direct: bool, path: str) -> int:
        """Read up to ``length`` bytes at ``offset`` into the slot; a refused O_DIRECT read is redone
        buffered."""
        view = memoryview(slot.buf[:length].numpy())
        done = 0
        while done < length:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self._fall_back(path, exc)
                plain = os.open(path, os.O_RDONLY)
                try:
                    return done + _pread_all(plain, view[done:], offset + done)
                finally:
                    os.close(plain)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _read_plain(path: str, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(nbytes)
