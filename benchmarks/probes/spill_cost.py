"""What does the prefix cache's host spill cost per block, and why does it hit what it hits? (CPU, tiny model)

Replays ``benchmarks/promptcache.py``'s spill section (``--spill-docs`` documents of
``--spill-doc-tokens`` tokens asked about in turn, 3 rounds, a pool a third of their size) on the tiny
dummy model, with the host tier holding as many blocks as the GPU run's does (``module_host_bytes``
over an 8B block, 2 MiB: 2,048 blocks at the default 4 GiB), so the block mechanics are the GPU run's
and only the arithmetic is tiny. It counts, per evicted (spilled) and restored block:

- pinned buffers the spill allocates on CUDA (a new ``CopyStream.to_host`` buffer each, or a slab of
  the spill's pool; each a ``cudaHostAlloc`` once the caching host allocator has none that size);
- device<->host copies (D2H on a spill, H2D on a restore: one per run of host memory);
- host waits on a copy's event (``HostTier`` reading an entry it must wait for);
- Python time in ``PrefixSpill.save`` / ``restore``;

and the hit rate, host hits, spilled / restored blocks and host entries dropped (pushed out of the
host tier). On the CPU copies and waits are no-ops; the counts are those the CUDA path would make.

At d979dea (a new pinned buffer per eviction; restore read entries with ``get``, making them the
newest, then allocated, whose spill pushed out the next document's): 70 pinned buffers (one per
eviction, ~117 blocks: 234 MiB on the 8B), 3.0 host event waits per restored block, hit rate 33.3%
(49,248 host-hit tokens, as on the H100), 3,185 host entries pushed out. With ``kv/slab_pool.py`` and
restore taking its entries out first: no pinned allocation after start (one slab here; 64 of 64 MiB
pinned at engine start on the 8B), 141 D2H copies for 75 evictions, 96 H2D for 48 restores, no host
wait, hit rate 66.4% (98,304 tokens: every revisit, the 2/3 the tiers allow), nothing pushed out.

Run: PYTHONPATH=. python -m benchmarks.probes.spill_cost [--docs 24] [--doc-tokens 2048]
(~1-2 min on a 2-core CPU at the defaults)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import TINY, dummy_model
from benchmarks.harness.models import shipped_config
from prefixserve import LLM, SamplingParams
from prefixserve.kv import prefix_spill, tiers, transfer

try:
    from prefixserve.kv import slab_pool
except ImportError:  # a checkout before the spill's slab pool
    slab_pool = None

BLOCK = 16


def gpu_block_bytes(name: str = "llama-3.1-8b") -> int:
    """Bytes of one 16-token bf16 block of the GPU run's model (2 MiB for the 8B)."""
    cfg = shipped_config(name)
    dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * dim * 2 * BLOCK


def tiny_block_bytes() -> int:
    """Bytes of one 16-token block of the tiny model in float32 (the CPU's dtype)."""
    dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    return 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * dim * 4 * BLOCK


def wrap(
    owner: Any, name: str, counts: Counter[str], times: Counter[str], hook: Callable | None = None
) -> None:
    """Count calls of ``owner.name`` and their wall time (if it exists on this checkout)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapped(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        times[name] += time.perf_counter() - t0
        counts[name] += 1
        if hook is not None:
            hook(counts, a, kw, out)
        return out

    setattr(owner, name, wrapped)


def instrument(counts: Counter[str], times: Counter[str]) -> None:
    def to_host(c: Counter[str], a: Any, kw: Any, out: Any) -> None:
        c["pinned_allocs"] += 1  # a new pinned buffer per call on CUDA
        c["d2h_copies"] += 1

    def aligned(c: Counter[str], a: Any, kw: Any, out: Any) -> None:
        c["pinned_allocs"] += 1

    def copy_out(c: Counter[str], a: Any, kw: Any, out: Any) -> None:
        c["d2h_copies"] += 1

    def copy_in(c: Counter[str], a: Any, kw: Any, out: Any) -> None:
        c["h2d_copies"] += 1

    def landed(c: Counter[str], a: Any, kw: Any, out: Any) -> None:
        c["host_event_waits"] += 1  # every spilled entry carries its D2H event on CUDA

    def put(c: Counter[str], a: Any, kw: Any, out: Any) -> None:
        c["host_dropped"] += len(out)

    cs = transfer.CopyStream
    wrap(cs, "to_host", counts, times, to_host)  # the spill's path before slab_pool.py
    wrap(cs, "copy_out", counts, times, copy_out)
    wrap(cs, "copy_in", counts, times, copy_in)
    wrap(slab_pool, "aligned_bytes", counts, times, aligned)  # a slab: pinned on CUDA
    wrap(tiers._HostEntry, "landed", counts, times, landed)
    wrap(tiers.HostTier, "put", counts, times, put)
    wrap(prefix_spill.PrefixSpill, "save", counts, times)
    wrap(prefix_spill.PrefixSpill, "restore", counts, times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    host_blocks = args.host_bytes // gpu_block_bytes()
    out: dict[str, Any] = {"docs": args.docs, "doc_tokens": args.doc_tokens, "host_blocks": host_blocks}
    with tempfile.TemporaryDirectory() as tmp:
        model = dummy_model(TINY, Path(tmp) / "tiny")
        for spill in (False, True) if args.compare else (True,):
            counts: Counter[str] = Counter()
            times: Counter[str] = Counter()
            if spill:
                instrument(counts, times)  # before the engine binds ``PrefixSpill.save`` to its pool
            blocks = args.docs * args.doc_tokens // BLOCK // 3 + 8  # as promptcache.py's run_spill
            llm = LLM(
                model,
                device="cpu",
                progress=False,
                num_kv_blocks=blocks,
                block_size=BLOCK,
                max_num_batched_tokens=8192,
                spill_prefix_cache=spill,
                module_host_bytes=host_blocks * tiny_block_bytes(),  # as many blocks as the GPU run's
            )
            rng = random.Random(5)
            docs = [[rng.randrange(1000, 40000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
            t0 = time.perf_counter()
            for r in range(args.rounds):
                for d in docs:
                    question = [500 + r, 600, 601, 602, 603, 604, 605, 606]
                    llm.generate({"prompt_token_ids": d + question}, SamplingParams(max_tokens=1))
            m = llm.metrics()
            tag = "spill" if spill else "no_spill"
            out[f"{tag}_s"] = time.perf_counter() - t0
            out[f"{tag}_hit_rate"] = m["prefix_cache_hit_tokens_total"] / m["prompt_tokens_total"]
            out[f"{tag}_host_hit_tokens"] = m["prefix_cache_host_hit_tokens_total"]
            out["kv_blocks"] = blocks
            sp = llm.engine.spill
            if sp is not None:
                spilled, restored = sp.spilled_blocks, sp.restored_blocks
                if hasattr(sp, "host_capacity_blocks"):
                    out["host_capacity_blocks"] = sp.host_capacity_blocks
                    out["slabs"] = sp.slots.allocations
                out |= {"spilled_blocks": spilled, "restored_blocks": restored, **counts}
                out["save_us_per_block"] = 1e6 * times["save"] / max(1, spilled)
                out["restore_us_per_block"] = 1e6 * times["restore"] / max(1, restored)
                out["pinned_allocs_per_eviction"] = counts["pinned_allocs"] / max(1, counts["save"])
                out["host_waits_per_restored_block"] = counts["host_event_waits"] / max(1, restored)
            print(json.dumps(out))
            del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--host-bytes",
        type=int,
        default=4 << 30,
        help="the GPU run's host tier (bytes of 8B blocks; the engine default, 4 GiB)",
    )
    ap.add_argument("--compare", action="store_true", help="also run with spill off")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
