"""The engine: one ``step`` = schedule -> build batch -> forward -> sample -> update sequences.

Everything above (the LLM API, the CLI, the server) drives an Engine through ``add_request``,
``abort`` and ``step``; everything below (model, KV pool, scheduler, attention) knows nothing of
requests beyond the Sequence objects handed to it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from prefixserve.attention.backend import make_backend
from prefixserve.attention.metadata import build_metadata
from prefixserve.config import EngineConfig
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.cache import KVCache, blocks_for_budget
from prefixserve.model.loader import load_model, load_tokenizer, resolve_model
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.sampler import sample
from prefixserve.scheduler.blocks import BlockManager
from prefixserve.scheduler.scheduler import Scheduler
from prefixserve.sequence import Request, Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PinnedPrompt:
    """An application's system prompt whose KV is computed once and never evicted."""

    name: str
    token_ids: list[int]
    blocks: list[int]  # the full blocks, held by the pin


class Engine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True) -> None:
        self.config = config = config or EngineConfig()
        self.device, self.dtype = config.torch_device, config.torch_dtype
        source = resolve_model(config.model)
        self.model_name = source.name
        self.model, tok_dir = load_model(source, self.dtype, self.device, config.seed, progress)
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(tok_dir)
        bs = config.block_size
        context = config.max_model_len or self.model_config.max_position_embeddings
        num_blocks = config.num_kv_blocks or blocks_for_budget(
            self.model_config,
            bs,
            self.dtype,
            self.device,
            config.memory_fraction,
            max_blocks=-(-context // bs) * config.max_num_seqs,
        )
        self.max_model_len = min(context, num_blocks * bs)
        self.kv = KVCache(self.model_config, num_blocks, bs, self.dtype, self.device)
        self.pool = BlockPool(num_blocks, bs)
        self.blocks = BlockManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_batched_tokens, config.max_num_seqs)
        self.backend = make_backend(config.attention)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self.counters: Counter[str] = Counter()
        # Wall time of steps, and the part spent outside the forward pass + sampling (scheduling,
        # planning, metadata, bookkeeping): the host overhead a GPU would wait on.
        self.timers: Counter[str] = Counter()
        self._device_seconds = 0.0
        self._next_seq_id = 0
        self._finished_outputs: list[RequestOutput] = []
        self._default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.pinned: dict[str, PinnedPrompt] = {}
        for name, text in config.system_prompts.items():
            self.pin_system_prompt(name, text)
        # A sequence must always fit in the blocks nobody pins, or it could preempt itself forever.
        unpinned = self.pool.num_blocks - sum(len(p.blocks) for p in self.pinned.values())
        self.max_model_len = min(self.max_model_len, unpinned * bs)
        if self.max_model_len < 2:
            raise ValueError("pinned system prompts leave no room in the KV pool; add blocks or pin less")

    # ---- pinned system prompts (RelayAttention) ------------------------------------------------
    def render_system_prompt(self, text: str) -> list[int]:
        """Token ids of a system prompt as the chat template renders it at the start of a chat."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot pin a system prompt given as text")
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": text}], tokenize=False
            )
        else:
            rendered = text
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def pin_system_prompt(self, name: str, text: str) -> PinnedPrompt:
        """Compute an application's system prompt KV once and hold its full blocks for good.

        Pinned blocks carry a reference of their own, so they are never evicted; any request whose
        prompt starts with these tokens (named by ``application=`` or not) finds them in the prefix index.
        """
        if not self.config.enable_prefix_caching:
            raise ValueError("pinned system prompts need the prefix cache (enable_prefix_caching=True)")
        if not name or name in self.pinned:
            raise ValueError(f"application name {name!r} is empty or already pinned")
        if self.requests:
            raise RuntimeError("pin system prompts at start-up, before any request is queued")
        tokens = self.render_system_prompt(text)
        if not tokens or len(tokens) >= self.max_model_len:
            raise ValueError(f"system prompt of application {name!r} is empty or longer than the context")
        # Start-up work, not traffic: the metrics are put back as they were afterwards.
        counters, timers = Counter(self.counters), Counter(self.timers)
        request_id = f"__pin__{name}"
        req = self.add_request(request_id, params=SamplingParams(max_tokens=1), prompt_token_ids=tokens)
        while request_id in self.requests:
            self.step()
        # The finished prompt's full blocks are now free but indexed: take them out of reach of eviction.
        digests = self.blocks.digests(req.sequences[0], len(tokens) // self.config.block_size)
        blocks = self.pool.lookup(digests)
        if len(blocks) != len(digests):
            raise RuntimeError(f"pinning {name!r}: {len(digests) - len(blocks)} blocks were evicted at once")
        self.pool.acquire(blocks)
        self._finished_outputs = []
        self.counters, self.timers = counters, timers
        pinned = PinnedPrompt(name, tokens, blocks)
        self.pinned[name] = pinned
        return pinned

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        prompt_positions: list[int] | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
        application: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the problem (nothing is queued then).

        ``application`` names a pinned system prompt: the prompt is put after it unless it already
        starts with it (a chat rendered with that system message).
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        tokens = list(prompt_token_ids)
        if application is not None:
            pinned = self.pinned.get(application)
            if pinned is None:
                raise ValueError(f"unknown application {application!r}; pinned: {sorted(self.pinned)}")
            if tokens[: len(pinned.token_ids)] != pinned.token_ids:
                if prompt_positions is not None:
                    raise ValueError("prompt_positions cannot be combined with an application prefix")
                tokens = pinned.token_ids + tokens
        if not tokens:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens, over the context length of {self.max_model_len} "
                "(leaving room for at least one generated token)"
            )
        room = self.max_model_len - len(tokens)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {len(tokens)} tokens and the "
                f"context length is {self.max_model_len}, so at most {room} tokens can be generated"
            )
        positions = list(prompt_positions) if prompt_positions is not None else list(range(len(tokens)))
        if len(positions) != len(tokens):
            raise ValueError("prompt_positions must have one position per prompt token")
        req = Request(request_id, prompt, tokens, positions, params, cache_salt, stream=stream)
        self.requests[request_id] = req
        self._new_sequence(req, 0, list(tokens), list(positions))
        self.scheduler.add(req.sequences[0])
        self.counters["requests_total"] += 1
        self.counters["prompt_tokens_total"] += len(tokens)
        return req

    def _new_sequence(self, req: Request, index: int, tokens: list[int], positions: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, tokens, positions)
        self._next_seq_id += 1
        if req.params.seed is not None:
            seed = hash((req.params.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        req.sequences.append(seq)
        return seq

    def abort(self, request_id: str, report: bool = True) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next ``step``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish_request(req, "abort", report)
        self.counters["requests_aborted_total"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of finished requests (and of streaming ones that moved)."""
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        self.counters["preemptions_total"] += len(sched.preempted)
        self.counters["prefix_cache_hit_tokens_total"] += sched.cache_hit_tokens
        outputs, self._finished_outputs = self._finished_outputs, []
        if not sched.scheduled:
            return outputs
        try:
            touched = self._run_batch(sched)
        except Exception:  # a failure fails this batch's requests, not the engine
            log.exception("engine step failed; failing the requests in this batch")
            touched = set()
            for s in sched.scheduled:
                if s.seq.request.request_id in self.requests:
                    self._finish_request(s.seq.request, "error")
            outputs, self._finished_outputs = outputs + self._finished_outputs, []
            return outputs
        for req in touched:
            if req.is_finished:
                self._retire(req)
                outputs.append(self._output(req))
            elif req.stream:
                outputs.append(self._output(req))
        total = time.perf_counter() - started
        self.timers["step_seconds_total"] += total
        self.timers["step_host_seconds_total"] += total - self._device_seconds
        return outputs

    def _run_batch(self, sched: Any) -> set[Request]:
        self.kv.copy_blocks(sched.copies)
        ids: list[int] = []
        pos: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for s in sched.scheduled:
            seq, c, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            ids += seq.token_ids[c : c + n]
            pos += seq.positions[c : c + n]
            query_lens.append(n)
            seq_lens.append(c + n)
            tables.append(seq.block_table[: self.blocks.blocks_needed(c + n)])
            self.counters["prompt_tokens_computed_total"] += max(0, min(c + n, seq.num_prompt_tokens) - c)
        meta = build_metadata(self.config.block_size, query_lens, seq_lens, tables, self.device)
        self.backend.prepare(meta)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(pos, dtype=torch.long, device=self.device)
        device_start = time.perf_counter()
        self._device_seconds = 0.0
        hidden = self.model(ids_t, pos_t, self.kv.layers, meta, self.backend)
        self._count_step(meta.stats, len(ids))

        rows: list[int] = []
        samplers: list[Sequence] = []
        end = 0
        for s in sched.scheduled:
            seq = s.seq
            end += s.num_tokens
            seq.num_computed_tokens += s.num_tokens
            self.blocks.register_computed(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing to sample yet
            for target in self._fork_if_needed(seq):
                rows.append(end - 1)
                samplers.append(target)
        touched = {s.seq.request for s in sched.scheduled}
        if not samplers:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._device_seconds = time.perf_counter() - device_start
            return touched
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        result = sample(
            logits,
            [q.request.params for q in samplers],
            [q.generator for q in samplers],
            self._default_generator,
        )  # returns host lists: the device work of this step is done here
        self._device_seconds = time.perf_counter() - device_start
        now = time.monotonic()
        for i, seq in enumerate(samplers):
            seq.append_token(result.tokens[i])
            if result.logprobs is not None and seq.request.params.logprobs is not None:
                seq.output_logprobs.append(result.logprobs[i])
                seq.output_top_logprobs.append(result.top_logprobs[i] if result.top_logprobs else [])
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            self.counters["generation_tokens_total"] += 1
            self._check_stop(seq)
        return touched

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """When sequence 0 of an n > 1 request finishes its prompt, split off the other samples."""
        req = seq.request
        if req.params.n == 1 or req.forked:
            return [seq]
        req.forked = True
        out = [seq]
        for index in range(1, req.params.n):
            child = self._new_sequence(req, index, list(seq.token_ids), list(seq.positions))
            self.blocks.fork(seq, child)
            self.scheduler.add_running(child)
            out.append(child)
        return out

    def _count_step(self, stats: dict[str, float], num_tokens: int) -> None:
        layers = self.model_config.num_hidden_layers
        c = self.counters
        c["steps_total"] += 1
        c["batched_tokens_total"] += num_tokens
        c["attention_kv_tokens_read_total"] += int(stats.get("kv_tokens_read", 0)) * layers
        c["attention_kv_tokens_logical_total"] += int(stats.get("kv_tokens_logical", 0)) * layers
        c["cascade_steps_total"] += int(stats.get("cascade", 0))
        c["shared_segments_total"] += int(stats.get("shared_segments", 0))
        self._last_step_segments = int(stats.get("shared_segments", 0))

    # ---- stopping and outputs ------------------------------------------------------------------
    def _check_stop(self, seq: Sequence) -> None:
        p = seq.request.params
        token = seq.token_ids[-1]
        out_len = seq.num_tokens - seq.num_prompt_tokens
        reason: str | None = None
        if out_len > p.min_tokens and not p.ignore_eos and token in self.eos_ids:
            reason, seq.stop_reason = "stop", None
        elif out_len > p.min_tokens and token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif p.stop and out_len > p.min_tokens and self._hit_stop_string(seq):
            reason = "stop"
        elif (p.max_tokens is not None and out_len >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self._decode(seq.output_token_ids)
        stops = seq.request.params.stop or []
        hits = [(text.find(s), s) for s in stops if s in text]
        if not hits:
            return False
        at, stop = min(hits)
        keep = at + len(stop) if seq.request.params.include_stop_str_in_output else at
        seq.output_text = text[:keep]
        seq.stop_reason = stop
        return True

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _finish_request(self, req: Request, reason: str, report: bool = True) -> None:
        for seq in req.sequences:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        req.forked = True  # no more samples will be split off
        self._retire(req)
        if report:
            self._finished_outputs.append(self._output(req))

    def _retire(self, req: Request) -> None:
        if self.requests.pop(req.request_id, None) is not None:
            req.finish_time = time.monotonic()
            self.counters["requests_finished_total"] += 1

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.sequences:
            text = seq.output_text if isinstance(seq.stop_reason, str) else self._decode(seq.output_token_ids)
            want_lp = req.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.output_logprobs) if want_lp else None,
                    top_logprobs=list(seq.output_top_logprobs) if want_lp else None,
                )
            )
        times = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            times["first_token_time"] = req.first_token_time
        if req.finish_time is not None:
            times["finish_time"] = req.finish_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=completions,
            finished=req.request_id not in self.requests,
            num_cached_tokens=req.num_cached_tokens,
            metrics=times,
        )

    # ---- observability -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            k: 0
            for k in (
                "requests_total",
                "requests_finished_total",
                "requests_aborted_total",
                "prompt_tokens_total",
                "prompt_tokens_computed_total",
                "prefix_cache_hit_tokens_total",
                "generation_tokens_total",
                "attention_kv_tokens_read_total",
                "attention_kv_tokens_logical_total",
                "cascade_steps_total",
                "shared_segments_total",
                "steps_total",
                "preemptions_total",
                "batched_tokens_total",
            )
        }
        out.update(self.counters)
        out.update(step_seconds_total=self.timers["step_seconds_total"])
        out.update(step_host_seconds_total=self.timers["step_host_seconds_total"])
        out.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=self.pool.num_used,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            kv_blocks_pinned=sum(len(p.blocks) for p in self.pinned.values()),
            shared_segments_per_step=getattr(self, "_last_step_segments", 0),
        )
        return out
