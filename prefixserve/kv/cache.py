"""The KV cache tensors (one K and one V per layer, paged), the copies between its blocks and a packed
host tensor, and how many blocks fit in memory.

Host rows written with ``scatter_rows_layered`` land layer by layer behind the next forward
(``kv/landing.py``): every method here that touches the pool settles the blocks it touches first, and
the model runner's forward waits per layer (``landing_hook``)."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from prefixserve.attention.kv_quant import FP8, as_bytes, scales_digest, with_scales, write_rows
from prefixserve.kv.landing import Landing, block_runs, rows_contiguous, worth_layering
from prefixserve.kv.layout import KVLayout, plain_layout
from prefixserve.kv.transfer import Ready, copy_stream
from prefixserve.model.config import ModelConfig
from prefixserve.model.parallel import Shard

# [layers, 2, rows, kv_heads, head_dim]: the KV rows of one entry, packed (no padding)
PackedKV = torch.Tensor


class KVCache:
    """All layers' paged K/V, in one allocation where every slot has one shape.

    ``layers[i]`` is (K, V) of layer i, each ``[num_blocks + 1, block_size, kv_heads, head_dim]``: the
    tensor of its slot (``kv/layout.py``; the plain layout gives every layer its own, the freeing
    layout puts a full layer and its sliding partners on one, addressed by different block tables).
    With one shape ``tensor`` is ``[slots, 2, num_blocks + 1, block_size, kv_heads, head_dim]``. The
    last block is scratch, outside the pool: a captured decode graph runs a fixed number of rows, and
    the padding rows write their K/V to ``scratch_slot`` so no pool block is touched.

    Under tensor parallelism each rank's cache holds its KV heads (``config`` is the rank's); packed
    rows always hold every head (``gather_rows`` joins the ranks', ``scatter_rows`` splits them), so
    host and disk entries do not depend on the rank count. Every rank makes the same calls. Packed
    rows (the host tier, Prompt Cache modules, disk) need the plain layout of one shape.

    An e4m3 ``dtype`` (``kv_cache_dtype="fp8"``) adds ``scales`` [layers, 2, kv_heads] fp32 (this rank's
    heads; 1 until ``set_scales``, which runs once, before any block is written) and each ``layers[i]``
    carries its layer's (``attention/kv_quant.py``); packed rows hold the e4m3 bytes as they are.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        shard: Shard | None = None,
        total_kv_heads: int | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        self.layout = layout = layout or plain_layout(config)
        if layout.uniform:
            heads, dim = layout.slot_shapes[0]
            self.tensor: torch.Tensor | None = pool_zeros(
                (layout.num_slots, 2, num_blocks + 1, block_size, heads, dim), dtype, device
            )
            slots = list(self.tensor)
        else:  # per-slot shapes (Gemma 4's global layers): one tensor each, no packed rows
            self.tensor = None
            slots = [
                pool_zeros((2, num_blocks + 1, block_size, h, d), dtype, device)
                for h, d in layout.slot_shapes
            ]
        self.slots = slots
        self.scales: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        # every rank's scales joined in head order (tensor parallelism; ``join_scales``): what the
        # scheme names, so that blocks hash alike whatever the rank count
        self.model_scales: torch.Tensor | None = None
        self.model_dtype: torch.dtype | None = None  # what an e4m3 cache's codes were computed in
        if dtype == FP8:  # padded to the widest layer's heads (Gemma 4's layers differ)
            heads = max(h for h, _ in layout.slot_shapes)
            self.scales = torch.ones(len(layout.slot_of), 2, heads, device=device)
            self.inverse = torch.ones_like(self.scales)
            self.model_scales = self.scales  # this rank's until ``join_scales``
        self.layers = [
            with_scales((slots[s][0], slots[s][1]), *self._layer_scales(i, slots[s].shape[-2]))
            for i, s in enumerate(layout.slot_of)
        ]
        self.block_size = block_size
        self.num_blocks = num_blocks  # blocks the pool hands out (the scratch block is not one)
        self.scratch_slot = num_blocks * block_size
        self.shard = shard or Shard()
        self.total_kv_heads = total_kv_heads or config.num_key_value_heads
        self.device = torch.device(device)
        self.packs = layout.is_plain and self.tensor is not None  # modules, KV files
        # the prefix cache's host tier moves whole blocks of every slot: one tensor and no freed pages
        # do (a hybrid's linear layers, or a layer reading another's KV, own no slot)
        self.spills = self.tensor is not None and layout.uniform and not layout.frees_sliding
        self.landing = (  # layer-by-layer copies index its events by layer: one slot a layer
            Landing(self._flat_view(), copy_stream(self.device), block_size) if self.packs else None
        )

    def _layer_scales(self, layer: int, heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer``'s scales and inverses (views: ``set_scales`` reaches them), or Nones."""
        if self.scales is None or self.inverse is None:
            return None, None
        return self.scales[layer, :, :heads], self.inverse[layer, :, :heads]

    def set_scales(self, scales: torch.Tensor, model_dtype: torch.dtype | None = None) -> None:
        """Fix the e4m3 scales ([layers, 2, kv_heads], this rank's heads), before any block is written:
        a block's scale never changes once it is written (its digest names the scales). ``model_dtype``:
        the dtype the model computes the KV in, which the scheme names too (an fp32 and a bf16 engine
        calibrate alike and store e4m3 alike, but not the same codes)."""
        if self.scales is None or self.inverse is None:
            raise ValueError("only an fp8 KV cache takes scales")
        if scales.shape != self.scales.shape:
            raise ValueError(f"scales {tuple(scales.shape)} != {tuple(self.scales.shape)}")
        self.scales.copy_(scales)
        self.inverse.copy_(1.0 / self.scales)
        self.model_scales = self.scales
        self.model_dtype = model_dtype

    def join_scales(self, per_rank: list[torch.Tensor]) -> None:
        """Every rank's scales (``per_rank[r]``: rank r's ``scales``, gathered) as the model's, in head
        order, for ``scheme``: a rank's span of the KV heads (``Shard.kv_head_span``) takes its columns;
        heads replicated across ranks are taken once. Layers with their own head counts (Gemma 4's
        global layers) keep this rank's scales named alone."""
        widths = {h for h, _ in self.layout.slot_shapes}
        if len(per_rank) == 1 or len(widths) != 1:
            return
        total = self.total_kv_heads
        joined = torch.empty(*self.scales.shape[:2], total, device=self.scales.device)
        for rank, scales in enumerate(per_rank):
            start, stop = type(self.shard)(rank=rank, size=len(per_rank)).kv_head_span(total)
            joined[:, :, start:stop] = scales[:, :, : stop - start].to(joined.device)
        self.model_scales = joined

    @property
    def scheme(self) -> bytes:
        """What block digests add for this cache's KV format: b"" for the model's dtype, else the e4m3
        scheme and the model's scales (``kv_quant.scales_digest``; under tensor parallelism every
        rank's joined, ``join_scales``, so a block's digest does not depend on the rank count)."""
        return scales_digest(self.model_scales, self.model_dtype)

    # ---- host rows landing layer by layer (kv/landing.py) ----------------------------------------
    def landing_hook(self) -> Callable[[int], None] | None:
        """For a forward about to be issued: what it calls before each layer touches the cache, or None
        when no host rows are landing (every step but those right after a host-tier restore)."""
        return self.landing.hook() if self.landing is not None else None

    def settle(self, blocks: Iterable[int] | None = None) -> None:
        """Make the current stream wait for host rows still landing (in ``blocks``, if given): for work
        on the pool outside a forward's layers."""
        if self.landing is not None:
            self.landing.settle(blocks)

    def issue_layered(self) -> None:
        """Start the copies ``scatter_rows_layered`` queued (a forward or ``settle`` would, later)."""
        if self.landing is not None:
            self.landing.issue()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate each ``src`` block's K/V into ``dst`` in every layer."""
        if not pairs:
            return
        self.settle([b for pair in pairs for b in pair])
        src, dst = torch.tensor(pairs, dtype=torch.long).T.contiguous()
        if self.device.type == "cuda":  # no blocking copy: the host may be ahead of the GPU
            src = src.pin_memory().to(self.device, non_blocking=True)
            dst = dst.pin_memory().to(self.device, non_blocking=True)
        if self.tensor is not None:
            whole = as_bytes(self.tensor)  # e4m3 moves as bytes
            whole[:, :, dst] = whole[:, :, src]
            return
        for slot in map(as_bytes, self.slots):
            slot[:, dst] = slot[:, src]

    def _slots(self, blocks: list[int], rows: int) -> torch.Tensor:
        """Slot ids (block * block_size + offset) of the first ``rows`` rows of ``blocks``, on the cache's
        device (``_check_blocks`` first)."""
        self._check_blocks(blocks, rows)
        bs = self.block_size
        base = torch.tensor(blocks, dtype=torch.long) * bs
        slots = (base[:, None] + torch.arange(bs, dtype=torch.long)).reshape(-1)[:rows]
        if self.device.type == "cuda":  # no blocking copy: the host may be ahead of the GPU
            slots = slots.pin_memory().to(self.device, non_blocking=True)
        return slots

    def _check_blocks(self, blocks: list[int], rows: int) -> None:
        """``blocks`` are the distinct pool blocks that ``rows`` rows fill. Checked on the host: on CUDA
        an out-of-range index is a device-side assert that kills the process."""
        bs = self.block_size
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        needed = -(-rows // bs)
        if len(blocks) != needed:
            raise ValueError(f"{rows} rows need {needed} blocks of {bs}, got {len(blocks)}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks are not distinct: {blocks}")
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside the pool's 0..{self.num_blocks - 1}")

    def _flat_view(self) -> torch.Tensor:
        """The cache as ``[layers, 2, all slots, kv_heads, head_dim]`` (a view: writes reach the cache)."""
        if not self.spills or self.tensor is None:
            raise ValueError(
                "this model's KV layout holds no packed rows (its sliding layers free blocks, or its "
                "layers' KV shapes differ): the host tier, Prompt Cache modules and KV files need "
                "keep_sliding_kv=True and one KV shape"
            )
        layers, two, nb, bs, heads, dim = self.tensor.shape
        return self.tensor.view(layers, two, nb * bs, heads, dim)

    def _rank_heads(self) -> list[tuple[int, int]]:
        """Every rank's [start, stop) of the model's KV heads (replicated heads appear more than once)."""
        size = self.shard.size
        return [Shard(r, size).kv_head_span(self.total_kv_heads) for r in range(size)]

    def _gathered(self, blocks: list[int], rows: int) -> torch.Tensor:
        """The first ``rows`` rows of ``blocks`` (every head) as a new tensor on the cache's device."""
        slots = self._slots(blocks, rows)
        self.settle(blocks)
        flat = self._flat_view()
        packed = as_bytes(flat).index_select(2, slots)  # contiguous, exactly `rows` rows (e4m3 as bytes)
        if self.shard.parallel:
            parts = [torch.empty_like(packed) for _ in range(self.shard.size)]
            dist.all_gather(parts, packed, group=self.shard.group)
            first = {span: i for i, span in reversed(list(enumerate(self._rank_heads())))}
            packed = torch.cat([parts[i] for _, i in sorted(first.items())], dim=3)
        return packed.view(flat.dtype)

    def gather_rows(self, blocks: list[int], rows: int) -> PackedKV:
        """Copy the first ``rows`` KV rows held in ``blocks`` (in order) of every layer to a new host tensor.

        ``blocks`` are exactly the ``ceil(rows / block_size)`` blocks that hold the rows, in order; the
        last may be partly filled (its rows past ``rows`` are not copied). Returns a contiguous CPU
        tensor ``[layers, 2, rows, kv_heads, head_dim]`` of the cache's dtype, every head of the model
        (under tensor parallelism the ranks' heads are gathered on the device first).

        Complete when this returns (``gather_rows_async`` and wait): one gather kernel on the current
        stream into a device temporary of exactly ``rows`` rows, then one D2H copy into pinned memory
        on the copy stream (``kv/transfer.py``), which the host waits for: that copy and the work queued
        before it on the current stream, no device-wide sync. Measured on an H100 (512 MiB, 4096 bf16
        rows of an 8B-shaped model): 11 ms (48 GB/s) once PyTorch's caching host allocator holds a pinned
        block of that size; the first pinned allocation costs ~0.4 s.
        """
        packed, ready = self.gather_rows_async(blocks, rows)
        if ready is not None:
            ready.synchronize()
        return packed

    def gather_rows_async(self, blocks: list[int], rows: int) -> tuple[PackedKV, Ready | None]:
        """``gather_rows`` without waiting: the host tensor and the event after its copy (None on a CPU).

        The gather is enqueued on the current stream (it sees every write enqueued there before), the
        copy on the copy stream; read the tensor on the host only after ``ready.synchronize()``; a copy
        back to the device on the copy stream is ordered after it anyway (``HostTier`` keeps the event)."""
        return copy_stream(self.device).to_host(self._gathered(blocks, rows))

    def gather_blocks(self, blocks: list[int]) -> tuple[torch.Tensor, Ready | None]:
        """Whole blocks, each contiguous across all layers: ``[len(blocks), layers, 2, block_size,
        kv_heads, head_dim]`` on the host, and the event after its copy, as ``gather_rows_async``.

        Block-major, so each block's KV is one contiguous piece (a prefix-cache entry of its own) and
        blocks that come back together go to the device in one copy; the device reorders them (one
        copy kernel) rather than the host."""
        return copy_stream(self.device).to_host(self.gather_blocks_device(blocks))

    def gather_blocks_device(self, blocks: list[int]) -> torch.Tensor:
        """``gather_blocks``' tensor left on the cache's device (enqueued on the current stream), for a
        caller that copies it into host memory it owns (``kv/prefix_spill.py``: reused pinned slots)."""
        layers, two, _, _, dim = self._flat_view().shape
        bs, n = self.block_size, len(blocks)
        packed = self._gathered(blocks, n * bs).view(layers, two, n, bs, self.total_kv_heads, dim)
        return as_bytes(packed).permute(2, 0, 1, 3, 4, 5).contiguous().view(packed.dtype)  # e4m3 as bytes

    def scatter_rows(self, blocks: list[int], packed: PackedKV) -> None:
        """Write ``packed`` rows into ``blocks``, in order: the inverse of ``gather_rows``.

        ``packed`` is ``[layers, 2, rows, kv_heads, head_dim]`` of the cache's dtype with every head of
        the model; ``blocks`` are ``ceil(rows / block_size)`` distinct pool blocks. Only the ``rows``
        slots are written: the rest of a partly filled last block, and every other block, are untouched.
        Under tensor parallelism rank 0 passes the rows and every other rank an empty tensor of their
        shape: rank 0's rows are broadcast, and each rank writes its heads.

        ``packed`` may be on the host or already on the cache's device (a disk entry read straight to the
        device). On CUDA a host ``packed`` goes over in one H2D copy on the copy stream (``kv/transfer.py``;
        through reused pinned slots if it is pageable), the current stream waits on its event, and one
        scatter kernel on the current stream writes the blocks. It returns without waiting: kernels
        enqueued later on the current stream see the data, the copy overlaps the steps queued before it,
        and the host goes on. Do not modify a pinned ``packed`` in place until the copy is done (dropping
        the reference is fine: the caching host allocator keeps pinned memory until then). Work on
        another stream must wait for the current stream first.
        """
        self._check_packed(packed)
        slots = self._slots(blocks, packed.shape[2])
        self.settle(blocks)
        src = copy_stream(self.device).to_device(packed)
        if self.shard.parallel:
            src = src.contiguous()  # maybe a row range of a larger host tensor (the host tier's)
            dist.broadcast(as_bytes(src), src=0, group=self.shard.group)  # e4m3 as bytes
            start, stop = self._rank_heads()[self.shard.rank]
            src = src[:, :, :, start:stop]
        write_rows(self._flat_view(), slots, src, dim=2)

    def scatter_rows_layered(self, blocks: list[int], packed: PackedKV) -> None:
        """``scatter_rows`` of host rows landing layer by layer behind the next forward (``kv/landing.py``):
        queued here, issued by ``issue_layered`` or the next forward, each layer's copy on the copy
        stream straight into the blocks, and each layer of the forward waiting for its own. Work on
        these blocks outside a forward's layers must ``settle`` first (this class's methods do).

        ``scatter_rows`` itself (the whole copy, then the scatter) for what cannot land by layers:
        under tensor parallelism (rank 0's rows are broadcast), rows already on the device, a pageable
        host tensor on CUDA, one whose layers' K and V rows are not each contiguous, and copies too
        small to pay their issue cost. ``packed`` may be a row range of a larger host tensor (the
        host tier's pieces moved out together): it then joins the copies of the entry queued before
        it where their rows and blocks follow one another (``Landing.queue``).
        """
        self._check_packed(packed)
        rows = packed.shape[2]
        self._check_blocks(blocks, rows)
        cuda = self.device.type == "cuda"
        runs = block_runs(blocks, rows, self.block_size)
        row_bytes = math.prod(packed.shape[3:]) * packed.element_size()
        layered = (
            not self.shard.parallel
            and packed.device.type == "cpu"
            and rows_contiguous(packed)
            and (not cuda or packed.is_pinned())
            and worth_layering(runs, row_bytes, cuda, self.landing.joins(packed, runs))
        )
        if not layered:
            self.scatter_rows(blocks, packed)
            return
        self.landing.queue(blocks, packed, runs)

    def _check_packed(self, packed: PackedKV) -> None:
        layers, two, _, _, dim = self._flat_view().shape
        heads = self.total_kv_heads
        shape = tuple(packed.shape)
        if len(shape) != 5 or shape[:2] + shape[3:] != (layers, two, heads, dim):
            raise ValueError(
                f"packed shape {shape} does not fit the cache: want ({layers}, {two}, rows, {heads}, {dim})"
            )
        if packed.dtype != self.slots[0].dtype:
            raise ValueError(f"packed dtype {packed.dtype} != cache dtype {self.slots[0].dtype}")


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for the KV pool. On the CPU it lies in an anonymous private mapping: the kernel
    hands out zero pages as they are first written, so resident memory grows with the blocks in use,
    not with the pool's size (``torch.zeros`` writes every page: on a 2-core VM 2.3 GB took seconds,
    all of it resident for a four-token answer). Elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps ``buf`` alive


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, layout: KVLayout | None = None
) -> int:
    """Bytes of one pool block (a page of every slot of the layout; the plain layout by default)."""
    elements = (layout or plain_layout(config)).page_elements(block_size)
    return elements * torch.tensor([], dtype=dtype).element_size()


GIB = 1 << 30


def available_memory(device: torch.device) -> int:
    """Free bytes the KV cache may draw from: free GPU memory, or physical RAM on a CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what loading freed (e.g. dummy weights drawn whole, then sliced) counts
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def blocks_for_budget(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_fraction: float,
    max_blocks: int | None = None,
    reserve: int = 0,
    utilization: float | None = None,
    layout: KVLayout | None = None,
) -> int:
    """Blocks that fit in ``memory_fraction`` of the available memory, leaving at least ``reserve``
    bytes of it for the steps, capped at ``max_blocks``. ``utilization`` (a GPU): instead, what is
    left of that share of the GPU's whole memory after everything it holds now (vLLM's
    ``gpu_memory_utilization``), less ``reserve``."""
    available = available_memory(device)
    if utilization is not None and device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        budget = int(total * utilization) - (total - available) - reserve
        if budget < bytes_per_block(config, block_size, dtype, layout):
            raise ValueError(
                f"gpu_memory_utilization {utilization} allows {total * utilization / GIB:.1f} GiB of "
                f"{device}'s {total / GIB:.1f} GiB, but {(total - available) / GIB:.1f} GiB is already "
                f"in use (this engine's weights and any other process) and a step needs "
                f"{reserve / GIB:.1f} GiB more: raise gpu_memory_utilization"
            )
    else:
        budget = int(min(available * memory_fraction, available - reserve))
    blocks = budget // bytes_per_block(config, block_size, dtype, layout)
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    if blocks < 1:
        raise ValueError(
            f"memory fraction {memory_fraction} leaves no room for one KV block "
            f"({bytes_per_block(config, block_size, dtype, layout)} bytes)"
        )
    return int(blocks)
