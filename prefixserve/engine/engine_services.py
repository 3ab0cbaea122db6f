"""What an Engine offers besides its loop: the device side as callers inspect it, applications' pinned
system prompts, Prompt Cache schemas, structured decoding's set-up, and observability (metrics, the
prefix cache's events for a replica router). ``Engine`` (``llm_engine``) inherits it, so the loop's
module holds only requests and the order of a step."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.engine.hybrid import SCHEMA_REFUSAL
from prefixserve.engine.request_rules import close_structured, structured_decoding
from prefixserve.engine.system_prompts import SystemPromptKV, pin_system_prompt, render_system_prompt
from prefixserve.engine.warmup import plan_covers, warm_argmax, warm_decode_graphs, warm_mixed_steps
from prefixserve.kv.cache import KVCache
from prefixserve.kv.cache_events import DEFAULT_CONSUMER, CacheEvents, enable_cache_events
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.sampling.rules import RuleSet
from prefixserve.worker.cuda_graph import DecodeGraphs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from prefixserve.attention.backend import AttentionBackend
    from prefixserve.config import EngineConfig
    from prefixserve.engine.stats import EngineStats
    from prefixserve.kv.block_pool import BlockPool
    from prefixserve.kv.prefix_spill import PrefixSpill
    from prefixserve.model.config import ModelConfig
    from prefixserve.outputs import RequestOutput
    from prefixserve.promptcache.store import PromptModules
    from prefixserve.sequence import Request
    from prefixserve.worker.model_runner import ModelRunner


class EngineServices:
    """Mixed into ``Engine``: everything here reads the attributes ``EngineSetup._set_up`` sets."""

    runner: ModelRunner  # under tensor parallelism, its subclass ``TensorParallelRunner`` (rank 0)
    pool: BlockPool
    spill: PrefixSpill | None
    modules: PromptModules
    tokenizer: PreTrainedTokenizerBase
    stats: EngineStats
    rules: RuleSet
    model_config: ModelConfig
    config: EngineConfig
    eos_ids: set[int]
    _finished_outputs: list[RequestOutput]
    requests: dict[str, Request]

    def shutdown(self) -> None:
        """Release the device side: under tensor parallelism, stop the worker processes; end the
        structured decoding's matcher process."""
        self.runner.shutdown()
        close_structured(self.rules)

    # ---- the device side, as callers and tests inspect it --------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def kv(self) -> KVCache:
        return self.runner.kv

    @property
    def backend(self) -> AttentionBackend:
        return self.runner.backend

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    def capture_graphs(self, progress: bool = False, seal: bool = False) -> int:
        """Capture now the graphs serving meets first; returns how many were captured.

        A server calls this before it says ready: captured lazily, each new size of prefill or
        mixed step, and each decode batch bucket, stalls every running stream for a warm-up forward
        and its captures. Dense pieces: one synthetic prefill per eager-step size over blocks taken
        from the pool and given back; decode graphs: ``warmup.warm_decode_graphs``; then the kernels
        of eager steps that prefill behind one and two shared segments (``warmup.warm_mixed_steps``)
        and the greedy argmax of every row count (``warmup.warm_argmax``).
        ``seal`` (a server): no decode graph is captured after this; a step whose key none serves
        runs eagerly (``DecodeGraphs.seal``), where the plan covers the keys (``warmup.plan_covers``)."""
        pieces = self.runner.capture_pieces(self.pool)
        captured = pieces + warm_decode_graphs(self, progress) + warm_mixed_steps(self, progress)
        warm_argmax(self.runner, self.config.max_num_seqs)
        self.stats.compiles.serving()  # a compile from now on stalls live streams: each is logged
        if seal and plan_covers(self.runner):  # else graphs are still captured when first met
            self.graphs.seal()
        return captured

    # ---- pinned system prompts (RelayAttention) ------------------------------------------------
    def render_system_prompt(self, text: str) -> list[int]:
        """Token ids of a system prompt as the chat template renders it at the start of a chat."""
        return render_system_prompt(self.tokenizer, text)

    def pin_system_prompt(self, name: str, text: str) -> SystemPromptKV:
        """Compute an application's system prompt KV once and hold its full blocks for good."""
        held = pin_system_prompt(self, name, text)
        self._finished_outputs = []
        return held

    # ---- Prompt Cache schemas -------------------------------------------------------------------
    def register_schema(
        self,
        text: str,
        encode: bool = True,
        pin: bool = False,
        replace: bool = False,
        module_recompute: str | None = None,
    ) -> str:
        """Register a PML schema (``PromptModules.add_schema``); returns its name."""
        if self.model_config.is_hybrid:
            raise ValueError(SCHEMA_REFUSAL)
        return self.modules.add_schema(text, encode, pin, replace, module_recompute)

    def unregister_schema(self, name: str) -> None:
        self.modules.unregister(name)

    def list_schemas(self) -> list[dict[str, Any]]:
        return self.modules.list_schemas()

    @property
    def structured(self) -> Any:  # StructuredDecoding | None: the engine core imports no rule module
        """Structured decoding's engine-wide part (grammar cache, mask buffers, the matcher process), as
        tests and probes inspect it; None before the first constrained request."""
        return structured_decoding(self.rules)

    def _structured(self) -> Any:
        """Structured decoding, set up now if no constrained request has yet (xgrammar is imported then)."""
        return structured_decoding(self.rules, self.tokenizer)

    def is_pml_prompt(self, prompt: str) -> bool:
        """A text prompt that is a Prompt Cache ``<prompt schema=...>`` document."""
        return is_pml_prompt(prompt)

    # ---- the prefix cache ------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget the automatic prefix cache (as vLLM's ``reset_prefix_cache``): every cached block
        nobody holds leaves the index, and the prefix blocks spilled to host memory are dropped, so
        later prompts compute their tokens again. Pinned system prompts, Prompt Cache modules and the
        blocks of requests still in the engine keep theirs. True when nothing but pins is left: no
        request was in the engine (else call it again once they have finished)."""
        gpu = self.pool.forget_unheld()
        host = self.spill.forget() if self.spill is not None else 0
        states = self.blocks.states
        if states is not None and states.spill is not None:  # a hybrid's snapshots in host memory
            states.spill.forget()
        self.stats.counters["prefix_cache_resets_total"] += 1
        self.stats.counters["prefix_cache_reset_blocks_total"] += gpu + host
        return not self.requests

    # ---- observability -------------------------------------------------------------------------
    @property
    def counters(self) -> Counter[str]:
        return self.stats.counters

    @property
    def timers(self) -> Counter[str]:
        return self.stats.timers

    def metrics(self) -> dict[str, float]:
        return self.stats.metrics(self)

    def drain_cache_events(self, full: bool = False, consumer: str = DEFAULT_CONSUMER) -> CacheEvents:
        """Prefix-index changes since ``consumer``'s last call, for a replica router (each router its
        own ``consumer``; the first call turns the log on and returns the whole index as a snapshot,
        as does ``full``). Call it on the engine's thread."""
        return enable_cache_events(self.pool).drain(full, consumer)


__all__ = ["EngineServices"]
