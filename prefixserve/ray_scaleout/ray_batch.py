"""Offline batches over Ray replicas: one engine per GPU (or per CPU replica) as a Ray actor.

The driver reads the input, answers what cannot run, plans prefix-sharing groups on the tokenizer
alone and shards the rows by group (a group never spans replicas; shards balanced by prefill
tokens). Each replica runs its shard with the single-process runner and streams output lines back;
the driver alone writes the output file, so resume works exactly as in one process. Also usable
from Ray Data: ``ds.map_batches(PrefixserveProcessor, fn_constructor_kwargs={...}, concurrency=N)``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.batch_file import BadRow, BatchRow, ResultWriter, error_row
from prefixserve.entrypoints.batch_runner import BatchProgress, pending_rows, plan_rows, run_rows, shard_rows


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("prefixserve batch --ray needs Ray: pip install 'prefixserve[ray]'") from exc
    return ray


class BatchReplica:
    """One engine; runs a shard of rows and yields their output lines as they finish."""

    def __init__(self, config: EngineConfig) -> None:
        from prefixserve.engine import Engine

        self.engine = Engine(config, progress=False)

    def run(self, rows: Sequence[BatchRow], grouping: str) -> Iterator[dict[str, Any]]:
        yield from run_rows(self.engine, rows, grouping)


def _default_replicas(ray: Any, device: str) -> int:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    return gpus if gpus and device != "cpu" else 2


def run_batch_file_ray(
    config: EngineConfig,
    path_in: str | Path,
    path_out: str | Path,
    replicas: int | None = None,
    grouping: str = "first_level",
    progress: bool = True,
) -> dict[str, Any]:
    """``prefixserve batch --ray``: the rows of ``path_in`` over Ray replicas into ``path_out``."""
    ray = _ray()
    from prefixserve.model.loader import tokenizer_for

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    replicas = replicas or _default_replicas(ray, config.device)
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    todo, skipped = pending_rows(path_in, path_out)
    name, tokenizer = tokenizer_for(config.model, progress=False, chat_template=config.chat_template)
    good = [r for r in todo if isinstance(r, BatchRow)]
    planned = plan_rows(tokenizer, name, config.system_prompts, good, grouping)
    shards = [s for s in shard_rows(planned, replicas) if s]
    bar = BatchProgress(len(todo) + skipped, progress, initial=skipped)
    written = errors = 0
    with ResultWriter(path_out) as writer:
        ready = [error_row(b) for b in todo if isinstance(b, BadRow)] + planned.answered
        for row in ready + list(_from_replicas(ray, config, shards, grouping)):
            writer.write(row)
            written += 1
            errors += row["response"] is None or row["response"]["status_code"] != 200
            bar.rows_done()
    bar.close()
    return {"rows_written": written, "rows_skipped": skipped, "error_rows": errors, "replicas": len(shards)}


def _from_replicas(
    ray: Any, config: EngineConfig, shards: list[list[BatchRow]], grouping: str
) -> Iterator[dict[str, Any]]:
    """Output lines from every replica as they come (a thread drains each replica's stream)."""
    gpu = config.torch_device.type == "cuda" if config.device != "cpu" else False
    actor_cls = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1)(BatchReplica)
    actors = [actor_cls.remote(config) for _ in shards]
    lines: queue.Queue[dict[str, Any] | BaseException | None] = queue.Queue()

    def drain(actor: Any, shard: list[BatchRow]) -> None:
        try:
            for ref in actor.run.options(num_returns="streaming").remote(shard, grouping):
                lines.put(ray.get(ref))
        except BaseException as exc:  # surfaced in the driver, not lost in a thread
            lines.put(exc)
        finally:
            lines.put(None)

    threads = [
        threading.Thread(target=drain, args=(a, s), daemon=True) for a, s in zip(actors, shards, strict=True)
    ]
    for t in threads:
        t.start()
    try:
        running = len(threads)
        while running:
            item = lines.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for actor in actors:
            ray.kill(actor)


class PrefixserveProcessor:
    """A Ray Data ``map_batches`` class: generates for a batch's ``prompt`` column, grouped by prefix.

    ``ds.map_batches(PrefixserveProcessor, fn_constructor_kwargs={"model": None, "max_tokens": 64},
    concurrency=2, batch_size=256)`` adds ``generated_text`` (and ``num_cached_tokens``) columns."""

    def __init__(
        self, model: str | None = None, max_tokens: int = 64, temperature: float = 0.0, **engine_kwargs: Any
    ) -> None:
        from prefixserve.entrypoints.llm import LLM
        from prefixserve.sampling.params import SamplingParams

        self.llm = LLM(model=model, progress=False, **engine_kwargs)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        prompts = [str(p) for p in batch["prompt"]]
        outs = self.llm.generate(prompts, self.params, schedule="batch")
        return {
            **batch,
            "generated_text": [o.outputs[0].text for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
        }
