"""Host work of one decode step, per component, measured on the CPU (no model forward).

Question (issue: host overhead < 10% of the decode step at B=256 on an 8B-shaped model): how many
microseconds of Python / numpy work does the engine spend per decode step outside the GPU's work, and
where? With CUDA graphs an 8B decode step on an H200 is ~5-8 ms at B=256, so the host must stay well
under ~0.5 ms there and grow gently with B.

The real ``Engine.step`` runs: scheduler, block manager, block pool, ``build_metadata``, the triton
backend's per-step planning (``make_plan`` and the host part of its graph step or eager layout: shared
work list, merge CSR), sampling's host part and the bookkeeping. The model is a stub that returns at
once, the vocabulary is tiny, and the KV cache is a stub; everything timed is host work. Components
are timed with ``perf_counter`` by thin wrappers around the engine's phases and collaborators (nothing
in the engine is changed); the engine's own loops are what is left of a phase once they are taken out.

Modes: ``graph`` (the decode path under CUDA graphs: ``backend.graph_step`` and the graph's host-side
``load`` of the step's arrays, done here on CPU buffers; the replay itself is not host work) and
``eager`` (``backend.prepare`` and the first layer's ``build_layout``).

State: B sequences sharing a P-token prompt prefix (computed once, then served from the prefix cache),
each with 64 tokens of its own prompt, admitted over 64 warm-up steps so that their generated lengths
are staggered (about B/16 sequences cross a block boundary every step, as in a real batch), block size
16. Then ``--steps`` decode-only steps are measured; each advances every sequence by one token.

``--variants proposed`` runs ``ProposedEngine`` below: the first recommendation (R1: block tables from
the block manager's numpy mirror, no per-step list slicing), which engine.py has since taken, so it is
``Engine`` now; see the notes in docs/benchmarks/host_overhead.md.

The engine's phases are timed where it has them (``_assemble_batch``, ``_launch``, ``_complete``;
``_plan`` and ``_run_batch`` in older versions), so the script keeps working while engine.py
changes; a phase it lacks reads 0 and its time shows up in "rest of step".

    python -m benchmarks.host_overhead                        # all B x P, both variants, writes docs
    python -m benchmarks.host_overhead --batches 256 --prefixes 4096 --no-write
    python -m benchmarks.host_overhead --batches 256 --prefixes 4096 --profile   # cProfile the steps
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import prefixserve.attention.planning.plan as plan_mod
import prefixserve.engine.engine_setup as engine_mod  # where the Engine loads its model
import prefixserve.worker.model_runner as runner_mod
from benchmarks.harness import run_info, write_results
from benchmarks.harness.info import cpu_model
from benchmarks.host_overhead_report import BLOCK, COMPONENTS, OWN, VOCAB, WARM, best_of, render
from prefixserve.attention.graph import HeadShape
from prefixserve.attention.triton_backend import TritonStep, build_layout
from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.kv.layout import plain_layout
from prefixserve.model.config import ModelConfig
from prefixserve.model.parallel import Shard
from prefixserve.sampling.params import SamplingParams

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B attention shapes

# (key, label) in table order; "total" is the whole Engine.step wall time. "engine: ..." rows are the
# engine's own code around its collaborators (what is left of a phase once they are taken out).


# the stub model's shape (what the engine reads of it: the KV cache's, the context, the vocabulary)
_MODEL_CONFIG = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=Q_HEADS * HEAD_DIM,
    intermediate_size=4 * Q_HEADS * HEAD_DIM,
    num_hidden_layers=32,
    num_attention_heads=Q_HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=1 << 20,
)


class _Recorder:
    """Time spent in the wrapped callables during one step (nested ones are subtracted out later)."""

    def __init__(self) -> None:
        self.acc: Counter[str] = Counter()

    def timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t0

        return wrapper

    def components(self, total: float) -> dict[str, float]:
        a = self.acc
        return {
            "schedule": a["schedule"],
            "gather": a["plan"] - a["build_metadata"] - a["attn_plan"],
            "build_metadata": a["build_metadata"],
            "make_plan": a["make_plan"],
            "plan_rest": a["attn_plan"] - a["make_plan"],
            "forward_host": a["forward"],
            "launch_rest": a["launch"] - a["forward"] - a["sample"],
            "sample": a["sample"],
            "complete": a["complete"],
            "step_rest": total - a["schedule"] - a["plan"] - a["launch"] - a["complete"],
            "total": total,
        }


class _StubModel:
    """Returns at once; in eager mode it does the first layer's host work (``build_layout``)."""

    config = full_config = _MODEL_CONFIG
    shard = Shard()  # the whole model, one process

    def __init__(self, rec: _Recorder, max_rows: int) -> None:
        self.rec = rec
        gen = torch.Generator().manual_seed(0)
        self._logits = torch.randn(max_rows, VOCAB, generator=gen)
        self._calls = 0

    def __call__(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        layers: Any,
        meta: Any,
        backend: Any,
        before_layer: Any = None,
    ) -> Any:
        step = meta.plan
        if isinstance(step, TritonStep) and step.shared is not None:
            build_layout(meta, step, Q_HEADS, KV_HEADS, HEAD_DIM, torch.device("cpu"), torch.bfloat16)
        return torch.zeros(ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        self._calls += 1  # a different (deterministic) draw each step
        return self._logits[: hidden.shape[0]].roll(self._calls, dims=1)


class _StubKV:
    layers: list[Any] = []  # noqa: RUF012
    scratch_slot = 0
    layout = plain_layout(_MODEL_CONFIG)  # every layer's KV, one group
    packs = True
    scales = None  # a model-dtype cache (no FP8 scales)
    scheme = b""  # its digests: the model dtype's (``KVCache.scheme``)

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass

    def landing_hook(self) -> None:
        """No host-tier KV ever lands here (``kv/landing.py``)."""
        return None

    def settle(self, blocks: Any = None) -> None:
        pass


class _StubGraphs:
    """``DecodeGraphs`` minus CUDA: buckets, the inputs' host mirror, and each key's attention ``load``.

    The attention objects are the real ones (``step.build()``), on CPU buffers; their host-to-device
    copy is skipped (on a GPU it is one asynchronous copy).
    """

    def __init__(self, rec: _Recorder, max_batch: int) -> None:
        from prefixserve.worker.cuda_graph import batch_buckets

        self.rec = rec
        self.shape = HeadShape(Q_HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
        self.buckets = batch_buckets(max_batch)
        self._host_np = np.zeros((3, self.buckets[-1]), dtype=np.int64)
        self.attention: dict[tuple[Any, ...], Any] = {}

    def bucket_for(self, batch: int) -> int | None:
        fits = [b for b in self.buckets if b >= batch]
        return fits[0] if fits else None

    def fit(self, step: Any) -> Any:
        """Every step runs in a graph of its own key (the stub captures nothing: it loads)."""
        return step

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: np.ndarray,
        step: Any,
        feed: Any = None,
        linear: Any = None,  # a hybrid's state slots: the stub model has none
    ) -> torch.Tensor:
        rows, bucket = len(ids), step.key[1]
        host = self._host_np
        host[0, :rows], host[1, :rows], host[2, :rows] = ids, positions, slots
        host[0, rows:bucket] = host[1, rows:bucket] = 0
        att = self.attention.get(step.key)
        if att is None:
            att = self.attention[step.key] = step.build()
        att.load(step.arrays)
        return torch.zeros(bucket, 1)  # the graph's whole output buffer


class ProposedEngine(Engine):
    """The engine with the change this page recommended first (R1: block tables gathered from the
    block manager's numpy mirror and handed to ``build_metadata`` as an array, a decode row's
    position read with one index). engine.py has since taken it, so this is ``Engine`` itself; the
    variant stays so the published before/after tables keep their column."""


def make_engine(batch: int, prefix: int, steps: int, variant: str, mode: str) -> tuple[Engine, _Recorder]:
    """A real Engine on the CPU with a stub model, KV cache and (graph mode) graph runner."""
    rec = _Recorder()
    gen_max = WARM + steps + 32
    num_blocks = prefix // BLOCK + batch * (-(-(OWN + gen_max) // BLOCK) + 1) + 64
    config = EngineConfig(
        model="stub",
        device="cpu",
        attention="triton",
        block_size=BLOCK,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=prefix + OWN * batch + batch,
        max_num_seqs=batch,
    )
    saved = (engine_mod.resolve_model, engine_mod.load_model, engine_mod.load_tokenizer, runner_mod.KVCache)
    engine_mod.resolve_model = lambda model: SimpleNamespace(name="stub")
    engine_mod.load_model = lambda *args, **kwargs: (_StubModel(rec, batch), None)
    engine_mod.load_tokenizer = lambda directory: None
    runner_mod.KVCache = lambda *args, **kwargs: _StubKV(rec)
    try:
        cls = ProposedEngine if variant == "proposed" else Engine
        eng = cls(config, progress=False)
    finally:
        engine_mod.resolve_model, engine_mod.load_model, engine_mod.load_tokenizer, runner_mod.KVCache = saved
    if mode == "graph":
        eng.runner.graphs = _StubGraphs(rec, batch)
    return eng, rec


def _instrument(eng: Engine, rec: _Recorder) -> Callable[[], None]:
    """Wrap the timed parts (those the engine has); returns a function that undoes the module patches."""
    sample_name = "sample_async" if hasattr(runner_mod, "sample_async") else "sample"
    saved = (runner_mod.build_metadata, getattr(runner_mod, sample_name), plan_mod.make_plan)
    runner_mod.build_metadata = rec.timed(saved[0], "build_metadata")
    setattr(runner_mod, sample_name, rec.timed(saved[1], "sample"))
    plan_mod.make_plan = rec.timed(saved[2], "make_plan")
    # the triton backend plans through step_plan.host_plan, which holds make_plan by its own name
    step_plan_mod = _step_plan_module()
    if step_plan_mod is not None:
        step_plan_mod.make_plan = plan_mod.make_plan
    backend = eng.backend
    backend.prepare = rec.timed(backend.prepare, "attn_plan")  # type: ignore[method-assign]
    backend.graph_step = rec.timed(backend.graph_step, "attn_plan")  # type: ignore[method-assign]
    eng.scheduler.schedule = rec.timed(eng.scheduler.schedule, "schedule")  # type: ignore[method-assign]
    # the engine's phases: planning (host metadata + attention plan), launch (forward + sampling
    # issued, bookkeeping), completion (tokens back: stops, outputs); older engines: _run_batch
    phases = (("_assemble_batch", "plan"), ("_plan", "plan"), ("_launch", "launch"))
    phases += (("_complete", "complete"),)
    for method, name in phases:
        if hasattr(eng, method):
            setattr(eng, method, rec.timed(getattr(eng, method), name))
    if not hasattr(eng, "_launch") and hasattr(eng, "_run_batch"):
        eng._run_batch = rec.timed(eng._run_batch, "launch")  # type: ignore[method-assign]
    forward = eng.graphs if eng.graphs is not None else eng.model
    if eng.graphs is not None:
        eng.graphs.run = rec.timed(eng.graphs.run, "forward")  # type: ignore[method-assign]
    else:
        eng.runner.model = _Timed(forward, rec)  # type: ignore[assignment]

    def undo() -> None:
        runner_mod.build_metadata, _, plan_mod.make_plan = saved
        setattr(runner_mod, sample_name, saved[1])
        if step_plan_mod is not None:
            step_plan_mod.make_plan = saved[2]

    return undo


def _step_plan_module() -> Any:
    """``attention/planning/step_plan.py`` where it exists and calls ``make_plan`` (older trees: None)."""
    try:
        import prefixserve.attention.planning.step_plan as step_plan_mod
    except ImportError:
        return None
    return step_plan_mod if hasattr(step_plan_mod, "make_plan") else None


class _Timed:
    """The stub model with its call (the eager first layer's host work) timed as "forward"."""

    def __init__(self, model: _StubModel, rec: _Recorder) -> None:
        self.model, self.config = model, model.config
        self.__call__ = rec.timed(model.__call__, "forward")

    def __call__(self, *args: Any) -> Any:
        return self.__dict__["__call__"](*args)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.model.compute_logits(hidden, fp32)


def measure(
    batch: int,
    prefix: int,
    steps: int,
    variant: str = "engine",
    mode: str = "graph",
    seed: int = 0,
    profiler: cProfile.Profile | None = None,
) -> dict[str, Any]:
    """Per-step host microseconds of each component (mean and median over ``steps`` decode steps)."""
    eng, rec = make_engine(batch, prefix, steps, variant, mode)
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, prefix).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=WARM + steps + 32, ignore_eos=True)
    undo = _instrument(eng, rec)
    try:
        added = 0
        for w in range(WARM + 16):  # staggered admissions, then a few decode-only steps
            upto = min(batch, (w + 1) * batch // WARM)
            for i in range(added, upto):
                own = rng.integers(0, VOCAB, OWN).tolist()
                eng.add_request(f"r{i}", params=params, prompt_token_ids=shared + own)
            added = upto
            eng.step()
        assert len(eng.scheduler.running) == batch and not eng.scheduler.waiting
        per_step: dict[str, list[float]] = {k: [] for k, _ in COMPONENTS}
        gc.collect()
        for _ in range(steps):
            rec.acc.clear()
            if profiler is not None:
                profiler.enable()
            t0 = time.perf_counter()
            eng.step()
            total = time.perf_counter() - t0
            if profiler is not None:
                profiler.disable()
            for k, v in rec.components(total).items():
                per_step[k].append(v * 1e6)
        segments = eng.counters["shared_segments_total"]
        eng.pool.check_integrity()
    finally:
        undo()
    return {
        "batch": batch,
        "prefix": prefix,
        "variant": variant,
        "mode": mode,
        "steps": steps,
        "shared_segments_per_step": segments / (WARM + 16 + steps),
        "mean_us": {k: round(statistics.fmean(v), 1) for k, v in per_step.items()},
        "median_us": {k: round(statistics.median(v), 1) for k, v in per_step.items()},
        "max_total_us": round(max(per_step["total"]), 1),
    }


def finish_step_ms(batch: int, prefix: int, gen: int = 12) -> tuple[float, float]:
    """Host ms of the step in which ``batch`` requests sharing a ``prefix``-token prompt, admitted
    together, all finish (blocks released, outputs built): the stub engine run to completion. Also
    the ms of one full GC pass (``gc.collect()``) halfway through decode, with every request live."""
    eng, _ = make_engine(batch, prefix, gen, "engine", "graph")
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, prefix).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i in range(batch):
        own = rng.integers(0, VOCAB, OWN).tolist()
        eng.add_request(f"r{i}", params=params, prompt_token_ids=shared + own)
    last = gc_ms = 0.0
    steps = 0
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        if len(outs) == batch or (outs and not eng.has_unfinished()):
            last = (time.perf_counter() - t0) * 1e3
        steps += 1
        if steps == gen // 2:
            t0 = time.perf_counter()
            gc.collect()
            gc_ms = (time.perf_counter() - t0) * 1e3
    eng.pool.check_integrity()
    return last, gc_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["graph"], choices=["graph", "eager"])
    ap.add_argument("--variants", nargs="+", default=["engine", "proposed"], choices=["engine", "proposed"])
    ap.add_argument("--before", type=Path, nargs="+", help="JSON of earlier runs: adds before/after tables")
    ap.add_argument("--from-json", type=Path, nargs="+", help="measure nothing: the docs from these runs")
    ap.add_argument("--json-out", type=Path, help="write the run's JSON here (no docs)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write docs/benchmarks")
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the measured steps; print, write nothing"
    )
    ap.add_argument(
        "--finish",
        action="store_true",
        help="the step in which the whole batch finishes, and a full GC pass mid-decode; print only",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.finish:
        for prefix in args.prefixes:
            for batch in args.batches:
                ms, gc_ms = finish_step_ms(batch, prefix)
                print(
                    f"B={batch:5d} P={prefix:6d}: the step in which every request finishes {ms:8.1f} ms;"
                    f" a full GC pass mid-decode {gc_ms:8.1f} ms"
                )
        return
    if args.from_json is not None:
        payloads = [json.loads(p.read_text()) for p in args.from_json]
        payload = {**payloads[-1], "rows": best_of([p["rows"] for p in payloads])}
        befores = [p["before_rows"] for p in payloads if p.get("before_rows")]
        befores += [json.loads(p.read_text())["rows"] for p in args.before or []]
        payload["before_rows"] = best_of(befores) if befores else None
        payload["runs"] = sum(p.get("runs", 1) for p in payloads)  # a regenerated file keeps its count
    else:
        configs = [
            (mode, variant, prefix, batch)
            for mode in args.modes
            for variant in args.variants
            for prefix in args.prefixes
            for batch in args.batches
        ]
        if args.profile:
            for mode, variant, prefix, batch in configs:
                prof = cProfile.Profile()
                measure(batch, prefix, args.steps, variant, mode, profiler=prof)
                print(f"== {mode} {variant} B={batch} P={prefix}: {args.steps} steps")
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        rows = []
        for mode, variant, prefix, batch in configs:
            r = measure(batch, prefix, args.steps, variant, mode)
            rows.append(r)
            print(
                f"{mode:5s} {variant:9s} B={batch:5d} P={prefix:6d}: "
                f"total {r['mean_us']['total']:9.1f} us/step (median {r['median_us']['total']:.1f})",
                flush=True,
            )
        before = best_of([json.loads(p.read_text())["rows"] for p in args.before]) if args.before else None
        payload = {**run_info(), "cpu": cpu_model(), "steps": args.steps, "rows": rows, "before_rows": before}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        return
    md = render(payload)
    if args.no_write:
        print(md)
    else:
        write_results("host_overhead", payload, md)


if __name__ == "__main__":
    main()
