"""Where a constrained decode step's host time goes, piece by piece, and which of it a GPU would wait on.

The schema and workload are ``benchmarks/structured.py``'s (B rows, JSON schema, greedy). A tiny
dummy model (2 layers, the default model's tokenizer and vocabulary) runs launched ahead on the CPU,
so the forward is cheap and the host's share shows. Prints:

- pieces, replayed over the rows' own walks: advancing B matchers one ``accept_token`` call a row
  (what the scheduler did) and in one ``batch_accept_token``; the B-row mask fill; the mask applied
  to B x vocab fp32 logits on the CPU (on a GPU this is a few queued kernels instead);
- whole engine steps, unconstrained and constrained: the step, the runner's forward and sampling
  (the device's work on a CPU; the sampling's logits, mask, mask kernel launch and draw apart), the
  rest (the engine's host work), the structured calls on the engine's thread, the rules' mask and
  the placing of the tokens, and the two gaps a GPU would see: from the tokens of step t on the host to the
  sampling of step t+1 issued (hidden while the forward of t+1 runs), and from that sampling issued
  to the forward of t+2 issued (the GPU idles for it, less the sampling's own time).

``--vocab N``: the tiny dummy's vocabulary N with a byte-level BPE tokenizer of N entries
(``benchmarks/harness/big_tokenizer.py``; 128256: a Llama-3 8B's) in place of the default model's.

PYTHONPATH=. python -m benchmarks.probes.structured_step [--batch 64] [--tokens 64] [--steps 40]
    [--vocab 128256] [--device cuda --model dummy:DIR]   (on a GPU: the gaps are real idle time then)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import TINY
from benchmarks.structured import SCHEMA, _conversations


def _llm(batch: int, device: str, model: str | None, vocab: int | None = None) -> Any:
    from prefixserve import LLM

    if model is None and vocab is not None:
        from benchmarks.harness.big_tokenizer import bpe_model

        model = bpe_model(TINY | {"vocab_size": vocab}, f"tiny-v{vocab}")
    if model is None:
        path = Path(tempfile.mkdtemp()) / "config.json"
        path.write_text(json.dumps(TINY))
        model = f"dummy:{path}"
    dtype = "bfloat16" if device == "cuda" else "float32"
    return LLM(
        model=model, device=device, dtype=dtype, max_num_seqs=max(batch, 8), enable_prefix_caching=False,
        async_scheduling=True, progress=False,
    )  # fmt: skip


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.3f}" if values else "    n/a"


def pieces(llm: Any, walks: list[list[int]], repeat: int) -> dict[str, list[float]]:
    """Each piece per step over the walks (rows that ended drop out), seconds."""
    import xgrammar as xgr

    from prefixserve.sampling.structured_outputs import StructuredOutputs
    from prefixserve.structured.bitmask import StepBitmasks
    from prefixserve.structured.matcher_process import _batch_accept

    sd = llm.engine._structured()
    compiled = sd.grammars.get(StructuredOutputs(json=SCHEMA))
    vocab = llm.engine.model_config.vocab_size
    masks = StepBitmasks(sd.words, "cpu", len(walks))
    one, accept = xgr.BatchGrammarMatcher(max_threads=1), _batch_accept(xgr)  # as the matcher process calls
    logits = torch.randn(len(walks), vocab)
    out: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeat):
        loop = [xgr.GrammarMatcher(compiled) for _ in walks]
        batch = [xgr.GrammarMatcher(compiled) for _ in walks]
        for j in range(max(map(len, walks))):
            live = [i for i, w in enumerate(walks) if j < len(w) and not batch[i].is_terminated()]
            if not live:
                break
            mask = masks.host(len(walks))
            t0 = time.perf_counter()
            one.batch_fill_next_token_bitmask([batch[i] for i in live], mask, live)  # one chunk's fill
            t1 = time.perf_counter()
            masks.apply(logits, mask, live)
            t2 = time.perf_counter()
            for i in live:
                loop[i].accept_token(walks[i][j])
            t3 = time.perf_counter()
            accept([batch[i] for i in live], [walks[i][j] for i in live])  # one call, as the engine
            t4 = time.perf_counter()
            out["fill"].append(t1 - t0)
            out["apply (CPU kernel)"].append(t2 - t1)
            out["accept, a call a row"].append(t3 - t2)
            out["accept, batched"].append(t4 - t3)
    return out


class StepClock:
    """Wraps the runner and the structured calls to time a step's parts and the GPU-facing gaps."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.t = engine, defaultdict(float)
        self.gap_fill: list[float] = []  # tokens of t on the host -> sampling of t+1 issued
        self.gap_launch: list[float] = []  # sampling issued -> next forward issued
        self._tokens_at: float | None = None
        self._sampled_at: float | None = None
        runner = engine.runner
        for name in ("forward", "sample", "wait"):
            setattr(runner, name, self._timed(getattr(runner, name), name))
        self.structured = engine._structured()
        for name in ("advance", "bitmask", "gated_mask"):
            setattr(self.structured, name, self._structured(getattr(self.structured, name), name))
        matchers = self.structured.matchers  # the answer of the matcher process: waited for in bitmask
        matchers.rows = self._structured(matchers.rows, "rows")
        # parts of the sampling and of placing the tokens, each timed where it is looked up
        import prefixserve.structured.bitmask as bitmask_mod
        import prefixserve.worker.model_runner as runner_mod

        self._modules: list[tuple[Any, str, Any]] = []  # (module, name, original): put back by ``undo``
        for module, name, label in (
            (runner_mod, "sample_async", "sample_async"),
            (bitmask_mod, "apply_token_mask", "mask kernel launch"),
        ):
            self._modules.append((module, name, getattr(module, name)))
            setattr(module, name, self._structured(getattr(module, name), label))
        self._objects: list[tuple[Any, str]] = [
            (runner.model, "compute_logits"),
            (self.structured.masks, "apply"),
            (self.structured.masks, "read"),  # a gated step's mask (structured/gate.py)
        ]
        self._objects += [(engine.rules, "restrict"), (engine, "_place_and_report")]
        for obj, name in self._objects:
            setattr(obj, name, self._structured(getattr(obj, name), name))

    def undo(self) -> None:
        """Put every wrapped function back."""
        for module, name, original in self._modules:
            setattr(module, name, original)
        for obj, name in [*self._objects, *((self.engine.runner, n) for n in ("forward", "sample", "wait"))]:
            vars(obj).pop(name, None)
        for name in ("advance", "bitmask", "gated_mask"):
            vars(self.structured).pop(name, None)
        vars(self.structured.matchers).pop("rows", None)

    def _structured(self, fn: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.t[name] += time.perf_counter() - t0
            return out

        return call

    def _timed(self, fn: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            if name == "forward" and self._sampled_at is not None:
                self.gap_launch.append(t0 - self._sampled_at)
                self._sampled_at = None
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
            self.t["runner"] += t1 - t0
            self.t[name] += t1 - t0
            self.t["runner cpu"] += time.thread_time() - c0
            if name == "wait":
                self._tokens_at = t1
            if name == "sample":
                if self._tokens_at is not None:
                    self.gap_fill.append(t0 - self._tokens_at)
                    self._tokens_at = None
                self._sampled_at = t1
            return out

        return call


def engine_steps(llm: Any, batch: int, tokens: int, steps: int, constrained: bool) -> dict[str, Any]:
    """Median per decode step: the step, the runner, the rest; the GPU-facing gaps."""
    from prefixserve import SamplingParams, StructuredOutputs

    engine = llm.engine
    spec = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=not constrained, structured_outputs=spec
    )
    prompts = [engine.tokenizer.apply_chat_template(c, tokenize=False) for c in _conversations(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{constrained}", p, params)
    clock = StepClock(engine)
    rows: dict[str, list[float]] = defaultdict(list)
    n = 0
    while engine.has_unfinished():
        clock.t.clear()
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        total, cpu = time.perf_counter() - t0, time.thread_time() - c0
        n += 1
        if n <= 3 or n > steps + 3:  # prefill and the first steps; the tail of the batch
            continue
        rows["step"].append(total)
        rows["runner (forward, sample, wait)"].append(clock.t["runner"])
        for name in ("forward", "sample", "wait"):
            rows[f"  runner: {name}"].append(clock.t[name])
        rows["engine host (the rest)"].append(total - clock.t["runner"])
        rows["  its CPU time (engine thread)"].append(cpu - clock.t["runner cpu"])
        rows["  structured: advance (accept)"].append(clock.t["advance"])
        rows["  structured: bitmask (fill/join)"].append(clock.t["bitmask"])
        rows["  structured: gated_mask (reserve)"].append(clock.t["gated_mask"])
        rows["  structured: waiting on the matcher process"].append(clock.t["rows"])
        for name in ("compute_logits", "apply", "read", "mask kernel launch", "sample_async"):  # sampling
            rows[f"  sample: {name}"].append(clock.t[name])
        rows["  rules: restrict (the mask)"].append(clock.t["restrict"])
        rows["  placing the tokens and reporting"].append(clock.t["_place_and_report"])
    clock.undo()
    return {"rows": rows, "gap_fill": clock.gap_fill[3:], "gap_launch": clock.gap_launch[3:]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed (after 3 untimed)")
    ap.add_argument("--repeat", type=int, default=3, help="replays of the walks for the pieces")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default=None, help="default: a tiny dummy model (a dummy needs a tokenizer)")
    ap.add_argument(
        "--vocab", type=int, default=None, help="the tiny dummy's vocabulary, with a BPE tokenizer"
    )
    ap.add_argument("--host-gate", action="store_true", help="the host waits for each fill (GATED off)")
    args = ap.parse_args(argv)
    from prefixserve.structured import decoding

    decoding.GATED = not args.host_gate
    if args.device == "cpu":
        torch.set_num_threads(1)  # the engine's thread and the fill's share the host
    llm = _llm(args.batch, args.device, args.model, args.vocab)
    from prefixserve import SamplingParams, StructuredOutputs

    spec = StructuredOutputs(json=SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, structured_outputs=spec)
    outs = llm.chat(_conversations(args.batch), params)  # warm-up, and the rows' walks
    walks = [list(o.outputs[0].token_ids) for o in outs]
    where = args.model or "tiny dummy model"
    where += f", tokenizer of {len(llm.engine.tokenizer):,} entries"
    print(f"B={args.batch}, {args.tokens} tokens, {where} launched ahead on {args.device}; ms a step")
    print("\npieces (median over the walks' steps)")
    for name, values in pieces(llm, walks, args.repeat).items():
        print(f"  {name:34s} {_ms(values)}")
    for constrained in (False, True):
        engine_steps(llm, args.batch, args.tokens, 4, constrained)  # warm
        res = engine_steps(llm, args.batch, args.tokens, args.steps, constrained)
        print(f"\nengine steps, {'json_schema' if constrained else 'unconstrained'} (median)")
        for name, values in res["rows"].items():
            print(f"  {name:34s} {_ms(values)}")
        if constrained:  # unconstrained, the sampling goes out right behind its forward
            print(f"  {'gap: tokens t -> sample t+1 issued':34s} {_ms(res['gap_fill'])}")
            print(f"  {'gap: sample issued -> next forward':34s} {_ms(res['gap_launch'])}")


if __name__ == "__main__":
    main()
