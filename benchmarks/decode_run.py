"""One timed decode run of B prompts sharing a prefix: the engine warmed on the same shapes first, then
decode-only tok/s, GPU idle share, GC pauses and the memory the run needs.

Shared by the throughput grid, tensor parallelism and the probes that time whole decode steps, so it
lives apart from any of those scripts.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from array import array

import torch

from benchmarks.harness import gpu_idle_frac
from prefixserve import LLM, SamplingParams

MODES = {"auto": "auto", "sharing_off": "triton_paged", "ceiling": "none"}


def _shared_keys(engine) -> list[tuple]:
    return [k for k in (engine.graphs.graphs if engine.graphs is not None else ()) if k[0] == "shared"]


def shared_prompts(batch: int, prefix: int, own: int, seed: int = 0) -> list[dict]:
    """``batch`` prompts: one shared ``prefix``-token run, then ``own`` tokens unique to each.

    Held as int64 arrays, as a big batch's caller should hold them: two sets of 1,024 16K-token lists
    are 33M elements that every full GC pass of the run would walk (~1 s each on the H100 host)."""
    rng = random.Random(seed)
    shared = array("q", [rng.randrange(1000, 30000) for _ in range(prefix)])
    return [
        {"prompt_token_ids": shared + array("q", [rng.randrange(1000, 30000) for _ in range(own)])}
        for _ in range(batch)
    ]


class GCPauses:
    """A ``gc.callbacks`` entry summing the time of the timed run's collections (a full pass over
    lists of token ids once took 1.8 s at 1024 x 16K, in the middle of decode)."""

    def __init__(self) -> None:
        self.total, self.full, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start
            self.full += info["generation"] == 2


def add_shared_run_args(ap: argparse.ArgumentParser, gen: int, short_gen: int) -> None:
    """The TP probes' run: a model over ``--tp`` ranks, ``--batch`` requests sharing a ``--prefix``-token
    run and ``--own`` tokens each, a long run of ``--gen`` tokens less a short one of ``--short-gen``."""
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--gen", type=int, default=gen)
    ap.add_argument("--short-gen", type=int, default=short_gen)


def decode_ms_per_step(outs: list, gen: int) -> float:
    """A run's first token to its last finish, per decode step."""
    first = max(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    return 1e3 * (last - first) / max(gen - 1, 1)


def measure(
    model: str,
    device: str,
    attention: str,
    prompts: tuple[list[dict], list[dict]],  # (measured, warm-up): same lengths, other tokens
    gen: int,
    n: int = 1,
    **engine: object,  # ``decode_engine``'s options (eager, tp, peer_allreduce, max_batched) and more
) -> dict:
    """One engine made for ``prompts`` (``decode_engine``), its timed run (``timed_decode``), and the
    engine shut down."""
    llm = decode_engine(model, device, attention, len(prompts[0]) * n, **engine)
    result = timed_decode(llm, device, prompts, gen, n)
    llm.shutdown()  # tensor parallelism: the workers and the process group go now, not at exit
    # the engine's memory goes back now, not when this frame ends: the next engine of the caller's
    # sizes its KV pool from the memory free at its start (allocator caches count as used)
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def decode_engine(
    model: str,
    device: str,
    attention: str,
    max_seqs: int,
    eager: bool = False,
    tp: int = 1,
    peer_allreduce: bool = True,
    max_batched: int = 16384,
    **engine: object,
) -> LLM:
    """The engine ``timed_decode`` runs on: ``model`` in bf16 (fp32 on a CPU) for ``max_seqs`` rows."""
    return LLM(
        tensor_parallel_size=tp,
        tp_peer_allreduce=peer_allreduce,
        model=model,
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        attention=attention,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched,
        enforce_eager=eager,
        progress=False,
        **engine,
    )


def timed_decode(
    llm: LLM,
    device: str,
    prompts: tuple[list[dict], list[dict]],  # (measured, warm-up): same lengths, other tokens
    gen: int,
    n: int = 1,
) -> dict:
    """A warm-up run of ``prompts[1]``, then the timed run of ``prompts[0]``: decode tok/s and what the
    timed run needed (the KV pool's peak is reset before it; the device's peak memory and
    ``graphs_captured`` count the engine's life). The engine stays: its caller may run more on it
    (an engine that loads in tens of seconds serves a grid of runs) and shuts it down."""
    prompts, warm = prompts
    # Warm-up: the same batch shape and lengths with other tokens, so kernels compile and the decode
    # graphs of this run are captured before the clock starts. As long as the timed run: its graph keys
    # change as the own parts grow (capacities, the kernel choice), and a key first met in the timed
    # window costs a capture plus any Triton compiles it needs (~0.5-3 s; docs/kernels.md §6)
    llm.generate(
        warm, SamplingParams(n=n, temperature=0.0 if n == 1 else 1.0, max_tokens=gen, ignore_eos=True)
    )
    # the pool's high-water mark from here: an engine that served runs before this one (a grid's)
    # would report theirs (the warm-up's is the same shape's)
    llm.engine.stats.kv_peak = 0
    before = llm.metrics()
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 1.0, seed=0, max_tokens=gen, ignore_eos=True)
    pauses = GCPauses()
    gc.callbacks.append(pauses)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        gc.callbacks.remove(pauses)
    elapsed = time.perf_counter() - t0
    after = llm.metrics()
    first = max(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    decode_tokens = sum(len(c.token_ids) - 1 for o in outs for c in o.outputs)
    steps = after["step_seconds_total"] - before["step_seconds_total"]
    host = after["step_host_seconds_total"] - before["step_host_seconds_total"]
    engine = llm.engine
    kv_block_bytes = engine.kv.tensor[:, :, 0].numel() * engine.kv.tensor.element_size()
    result = {
        "tok_s": decode_tokens / max(last - first, 1e-9),
        "graphs_captured": engine.graphs.captures if engine.graphs is not None else 0,
        # captured shared-path graphs whose segments were contiguous (TMA loads) / all shared ones
        "graphs_tma": sum(bool(k[4][3]) for k in _shared_keys(engine)),
        "graphs_shared": len(_shared_keys(engine)),
        "graphs_mixed": sum(k[4][5] is not None for k in _shared_keys(engine)),  # on the mixed kernel
        "kv_blocks_used_peak": after["kv_blocks_used_peak"],
        "kv_blocks_total": after["kv_blocks_total"],
        # a pool too small for the batch shows here: requests preempted (recomputed later) in the run
        "preemptions": after["preemptions_total"] - before["preemptions_total"],
        "steps": after["steps_total"] - before["steps_total"],
        "prefill_s": first - t0,
        "decode_window": (first, last),  # time.monotonic(), the engine's clock
        "elapsed_s": elapsed,
        "gc_pause_s": pauses.total,  # Python's cyclic GC, all generations, in the timed run
        "gc_full_passes": pauses.full,
        # the share of the GPU's time spent waiting for the host between steps (CUDA events; on a
        # CPU, the share of step time outside forward + sampling)
        "host_overhead_frac": gpu_idle_frac(before, after) if device == "cuda" else host / max(steps, 1e-9),
        "host_ms_per_step": 1e3 * host / max(1, after["steps_total"] - before["steps_total"]),
        "kv_read_saving_x": (
            after["attention_kv_tokens_logical_total"] - before["attention_kv_tokens_logical_total"]
        )
        / max(1, after["attention_kv_tokens_read_total"] - before["attention_kv_tokens_read_total"]),
    }
    if device == "cuda":  # what the run needs: all it allocated, with the KV pool counted as used, not sized
        kv_pool = engine.kv.tensor.numel() * engine.kv.tensor.element_size()
        peak = torch.cuda.max_memory_allocated() - kv_pool + after["kv_blocks_used_peak"] * kv_block_bytes
        result["memory_needed_gb"] = peak / 1e9
    return result
