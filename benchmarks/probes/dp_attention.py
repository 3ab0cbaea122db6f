"""Does data-parallel attention pay at TP=2: a decode layer's dense part with attention split by rows
instead of by heads?

Megatron's split meets the peer twice a layer with the whole batch ([B, hidden] each way, after the o
and down shards). With attention data-parallel each rank runs every head for its half of the batch,
with the whole qkv and o weights (twice the attention weights read), and meets the peer with half the
batch each way: its normalised rows gathered before the MLP (``peer_norm_gather`` here) and its rows
of the down products summed after it (``kernels/peer_norm.py`` on a row range). Two GPUs, one process
each; per batch B, 32 layers of distinct weights in one CUDA graph (weights out of L2), microseconds
a layer, attention itself left out of both (the same heads x sequences either way):

- ``tp1``: one GPU's layer (qkv, o, add-norm, gate-up, SiLU, down, add-norm), for the ratio;
- ``tp2``: the Megatron layer as the engine runs it (shards, the fused all-reduce + norm twice);
- ``dp2``: the data-parallel-attention layer.

Before timing, ``dp2``'s output rows are compared with ``tp2``'s on the same inputs (bf16: the o
product is one GEMM here and two rounded halves there, so they differ by rounding), and the ranks'
gathered MLP inputs must be equal bit for bit.

    PYTHONPATH=. python -m benchmarks.probes.dp_attention [--rows 64 128 256 512] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import run_info
from benchmarks.harness.ranks import join_group, leave_group, run_ranks
from benchmarks.harness.timing import ranks_graph_us
from prefixserve.model.kernels.peer_norm import MAX_HIDDEN, MAX_PROGRAMS, add_norm_store, wait_for_count
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()

EPS = 1e-5
HIDDEN, QKV, INTER = 4096, 6144, 14336  # Llama-3.1-8B
LAYERS = 32


# The all-gather with the norm: program i writes its share of this rank's rows, normalised, into the
# gathered buffer (symmetric memory), signals the peer's program i (release: the stores come first),
# waits for the peer's count as kernels/peer_norm.py does, then copies the peer's rows that program i
# there wrote.
@triton.jit(do_not_specialize=["n_rows", "n_peer_rows"])
def _norm_gather_kernel(
    prod_ptr,  # [R, N] this rank's rows of the product (summed already: the o projection's)
    res_ptr,  # [R, N] this rank's rows of the residual stream
    w_ptr,  # [N]
    out_ptr,  # [R, N] where this rank's normalised rows go: its rows of the gathered buffer
    res_out_ptr,  # [R, N] the residual stream plus the product
    src_ptr,  # [Rp, N] the peer's normalised rows, in the peer's gathered buffer
    dst_ptr,  # [Rp, N] the same rows of this rank's gathered buffer
    my_flags_ptr,  # [MAX_PROGRAMS] int64: the peer's program i writes its count of calls here
    peer_flags_ptr,  # [MAX_PROGRAMS] int64, in the peer's memory
    calls_ptr,  # [MAX_PROGRAMS] int64: this rank's own count of calls a program
    abort_ptr,  # [1] int32: nonzero once the peer is gone
    n_rows,
    n_peer_rows,
    n_cols,
    stride,
    eps,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, tl.num_programs(0)):
        at = row * stride + cols
        prod = tl.load(prod_ptr + at, mask=mask, other=0.0).to(tl.float32)
        add_norm_store(prod, at, mask, res_ptr, w, out_ptr, res_out_ptr, n_cols, eps, True)
    tl.debug_barrier()  # every thread's rows stored before the release below
    call = tl.atomic_add(calls_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    tl.atomic_xchg(peer_flags_ptr + pid, call, sem="release", scope="sys")
    wait_for_count(my_flags_ptr + pid, call, abort_ptr)
    for row in range(pid, n_peer_rows, tl.num_programs(0)):
        at = row * stride + cols
        tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=mask, other=0.0, volatile=True), mask=mask)


_bound = BoundKernel(_norm_gather_kernel)


def peer_norm_gather(
    product: torch.Tensor,  # [R, N] this rank's rows
    residual: torch.Tensor,  # [R, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    mine: torch.Tensor,  # [R, N] this rank's rows of the gathered buffer (a view of it)
    theirs: torch.Tensor,  # [Rp, N] the peer's rows of the gathered buffer, in the peer's memory
    landing: torch.Tensor,  # [Rp, N] the same rows of this rank's gathered buffer
    my_flags: torch.Tensor,  # [>= programs] int64
    peer_flags: torch.Tensor,  # the same, in the peer's memory
    calls: torch.Tensor,  # [>= programs] int64
    abort: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes ``rms_norm(product + residual) * weight`` into ``mine`` and the peer's rows into
    ``landing``; returns ``product + residual`` (this rank's new stream rows). The peer makes the same
    call with the two row counts swapped."""
    rows, n = product.shape
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden {n} must be <= {MAX_HIDDEN}")
    for name, t in (("residual", residual), ("mine", mine)):
        if t.shape != product.shape or t.dtype != product.dtype:
            raise ValueError(
                f"{name} {tuple(t.shape)} {t.dtype} must match {tuple(product.shape)} {product.dtype}"
            )
    if theirs.shape != landing.shape or theirs.shape[1:] != product.shape[1:]:
        raise ValueError(f"peer rows {tuple(theirs.shape)} / {tuple(landing.shape)} must be [Rp, {n}]")
    if not all(t.is_contiguous() for t in (product, residual, mine, theirs, landing)):
        raise ValueError("peer_norm_gather needs contiguous rows")
    res_out = torch.empty_like(product)
    programs = min(max(rows, theirs.shape[0]), MAX_PROGRAMS, my_flags.numel(), calls.numel())
    if programs == 0:
        return res_out
    if abort is None:
        abort = torch.zeros(1, dtype=torch.int32, device=product.device)
    block = triton.next_power_of_2(n)
    _bound(
        (programs,),
        product,
        residual,
        weight,
        mine,
        res_out,
        theirs,
        landing,
        my_flags,
        peer_flags,
        calls,
        abort,
        rows,
        theirs.shape[0],
        n,
        n,
        eps,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return res_out


def _weights(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(LAYERS)]


class Layers:
    """The three forms' weights, this rank's slice of them, and the symmetric buffers."""

    def __init__(self, rank: int, peer, gathered: tuple, flags: tuple) -> None:
        """``gathered``, ``flags``: (this rank's, the peer's) symmetric MLP input rows and meeting counts."""
        self.rank, self.peer = rank, peer
        self.qkv_full, self.o_full = _weights(QKV, HIDDEN), _weights(HIDDEN, HIDDEN)
        self.qkv_shard, self.o_shard = _weights(QKV // 2, HIDDEN), _weights(HIDDEN, HIDDEN // 2)
        self.gu_shard, self.down_shard = _weights(INTER, HIDDEN), _weights(HIDDEN, INTER // 2)
        self.gu_full, self.down_full = _weights(2 * INTER, HIDDEN), _weights(HIDDEN, INTER)
        self.norm_w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.gathered, self.peer_gathered = gathered
        self.flags, self.peer_flags = flags
        device = torch.device("cuda", rank)
        self.calls = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)

    def tp1(self, i: int, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor):
        from prefixserve.model import fused

        fused.linear(x, self.qkv_full[i])
        x, h = fused.add_rms_norm(fused.linear(attn, self.o_full[i]), self.norm_w, EPS, h)
        s = fused.silu_and_mul(fused.linear(x, self.gu_full[i]))
        return fused.add_rms_norm(fused.linear(s, self.down_full[i]), self.norm_w, EPS, h)

    def tp2(self, i: int, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor):
        """``attn``: every row's attention output for this rank's heads [B, hidden / 2]."""
        from prefixserve.model import fused
        from prefixserve.model.peer_allreduce import ATTENTION_SLOT, MLP_SLOT

        rows = x.shape[0]
        fused.linear(x, self.qkv_shard[i])
        o = self.peer.product_slot(ATTENTION_SLOT, rows, HIDDEN, x.dtype)
        fused.linear_into(attn, self.o_shard[i], o.mine)
        x, h = fused.add_rms_norm(o, self.norm_w, EPS, h)
        s = fused.silu_and_mul(fused.linear(x, self.gu_shard[i]))
        down = self.peer.product_slot(MLP_SLOT, rows, HIDDEN, x.dtype)
        fused.linear_into(s, self.down_shard[i], down.mine)
        return fused.add_rms_norm(down, self.norm_w, EPS, h)

    def dp2(self, i: int, x: torch.Tensor, h: torch.Tensor, attn: torch.Tensor, rows: int):
        """``x``, ``h``, ``attn``: this rank's half of the rows; returns the same."""
        from prefixserve.model import fused
        from prefixserve.model.kernels.peer_norm import peer_add_rms_norm
        from prefixserve.model.peer_allreduce import MLP_SLOT

        half = rows // 2
        mine_at, theirs_at = (0, half) if self.rank == 0 else (half, 0)
        fused.linear(x, self.qkv_full[i])
        o = fused.linear(attn, self.o_full[i])
        full = self.gathered[: rows * HIDDEN].view(rows, HIDDEN)
        peer_full = self.peer_gathered[: rows * HIDDEN].view(rows, HIDDEN)
        slots = self.peer.fused
        h = peer_norm_gather(
            o,
            h,
            self.norm_w,
            EPS,
            full[mine_at : mine_at + half],
            peer_full[theirs_at : theirs_at + half],
            full[theirs_at : theirs_at + half],
            self.flags,
            self.peer_flags,
            self.calls,
        )
        s = fused.silu_and_mul(fused.linear(full, self.gu_shard[i]))
        mine, peer = slots.views(MLP_SLOT, rows, HIDDEN, x.dtype)
        torch.mm(s, self.down_shard[i].t(), out=mine)
        return peer_add_rms_norm(
            mine[mine_at : mine_at + half],
            peer[mine_at : mine_at + half],
            h,
            self.norm_w,
            EPS,
            slots.counts,
            slots.peer_counts,
            calls=slots.calls,
        )


def _check(layers: Layers, rows: int) -> dict:
    """dp2's output rows against tp2's on the same layer input (the o shards made the o weight's
    column halves for it; the same on both ranks, as the replicated residual stream is), and every
    rank's gathered MLP input the same."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, h, attn = (
        torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3)
    )
    cols = slice(layers.rank * HIDDEN // 2, (layers.rank + 1) * HIDDEN // 2)
    dist.broadcast(layers.o_full[0], 0)  # every rank's own random weights elsewhere: one o weight here
    layers.o_shard[0].copy_(layers.o_full[0][:, cols])
    out_tp, h_tp = layers.tp2(0, x, h, attn[:, cols].contiguous())
    half = rows // 2
    mine = slice(0, half) if layers.rank == 0 else slice(half, rows)
    out_dp, h_dp = layers.dp2(0, x[mine].contiguous(), h[mine].contiguous(), attn[mine].contiguous(), rows)
    torch.cuda.synchronize()
    gathered = layers.gathered[: rows * HIDDEN].view(rows, HIDDEN).clone()
    every = [torch.empty_like(gathered) for _ in range(2)]
    dist.all_gather(every, gathered)
    return {
        "gathered_equal_on_ranks": bool(torch.equal(every[0], every[1])),
        "max_err_vs_tp2": float((out_dp.float() - out_tp[mine].float()).abs().max()),
        "max_err_stream_vs_tp2": float((h_dp.float() - h_tp[mine].float()).abs().max()),
    }


def _time(layers: Layers, rows: int) -> dict:
    """Microseconds a layer of each form at ``rows``, graphed."""
    x, h, attn = (torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    half = rows // 2
    xh, hh, ah = x[:half].contiguous(), h[:half].contiguous(), attn[:half].contiguous()
    heads = attn[:, : HIDDEN // 2].contiguous()
    return {
        "tp1_us": ranks_graph_us(lambda i: layers.tp1(i, x, h, attn), calls=LAYERS, reps=10),
        "tp2_us": ranks_graph_us(lambda i: layers.tp2(i, x, h, heads), calls=LAYERS, reps=10),
        "dp2_us": ranks_graph_us(lambda i: layers.dp2(i, xh, hh, ah, rows), calls=LAYERS, reps=10),
    }


def _worker(rank: int, size: int, init: str, queue, rows_list: list[int]) -> None:
    join_group(rank, size, init)
    import torch.distributed._symmetric_memory as symm_mem

    from prefixserve.model.peer_allreduce import PeerAllReduce

    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank), "probe-dp-attention")

    def shared(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's zeroed symmetric buffer, the peer's): a collective rendezvous."""
        mine = symm_mem.empty(numel, dtype=dtype, device="cuda")
        mine.zero_()
        handle = symm_mem.rendezvous(mine, "probe-dp-attention")
        return mine, handle.get_buffer(1 - rank, (numel,), dtype, 0)

    gathered = shared(max(rows_list) * HIDDEN, torch.bfloat16)
    flags = shared(MAX_PROGRAMS, torch.int64)
    torch.cuda.synchronize()
    dist.barrier()  # every rank's counts are zero before any rank signals
    layers = Layers(rank, peer, gathered, flags)
    result = []
    for rows in rows_list:
        row: dict = {"rows": rows, **_check(layers, rows), **_time(layers, rows)}
        result.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    leave_group(queue, rank, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--json", type=Path, help="also write this JSON, and the table beside it (.md)")
    args = ap.parse_args()
    result = run_ranks(_worker, (args.rows,), size=2, timeout=500)[0]
    info = run_info()
    lines = [
        "# Data-parallel attention at TP=2: an 8B decode layer's dense part",
        "",
        f"{info['device']} x 2, torch {info['torch']}, commit {info['commit']}, {info['date']}; us a layer, "
        "graphed (32 layers of distinct weights). Written by `benchmarks/probes/dp_attention.py`.",
        "",
        "| B | TP=1 | TP=2 Megatron | TP=2 DP attention | TP=1 / Megatron | TP=1 / DP attention "
        "| gathered equal | max err |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in result:
        lines.append(
            f"| {r['rows']} | {r['tp1_us']:.1f} | {r['tp2_us']:.1f} | {r['dp2_us']:.1f} | "
            f"{r['tp1_us'] / r['tp2_us']:.3f} | {r['tp1_us'] / r['dp2_us']:.3f} | "
            f"{r['gathered_equal_on_ranks']} | {r['max_err_vs_tp2']:.3g} |"
        )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({**info, "rows": result}, indent=1))
        args.json.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
