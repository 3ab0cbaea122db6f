"""The Python API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.engine.input_processor import check_context
from prefixserve.engine.pooling import embedding_output
from prefixserve.engine.prompt_tokens import encode_prompt, encode_prompts
from prefixserve.engine.system_prompts import opens_own_system, opens_with_pinned
from prefixserve.entrypoints.generation_config import sampling_defaults
from prefixserve.outputs import EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from prefixserve.pooling_params import PoolingParams, score_pairs
from prefixserve.promptcache.chat import chat_prompt as chat_as_pml
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.sampling.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    top_candidates,
    with_text,
)
from prefixserve.sampling.params import SamplingParams
from prefixserve.scheduler.batch_queue import queue_groups

# "text" or {"prompt": ..., "prompt_token_ids": ..., "cache_salt": ..., "public_tokens": ...}: with a salt,
# the prompt's first public_tokens are public (blocks wholly inside them shared across salts)
Prompt = str | dict[str, Any]
Message = dict[str, str]


class LLM:
    """Offline inference over the engine. Extra keyword arguments are EngineConfig fields."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        attention: str = "auto",
        progress: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig(model=model, dtype=dtype, device=device, attention=attention, **engine_kwargs)
        self._start(config, progress)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, progress)
        return llm

    def _start(self, config: EngineConfig, progress: bool) -> None:
        self._sampling_defaults = sampling_defaults(config)  # checked before the model loads
        self.engine = Engine(config, progress=progress)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no SamplingParams: vLLM's defaults,
        with the model's generation config over them (``generation_config``,
        ``override_generation_config``)."""
        return SamplingParams(**self._sampling_defaults)

    def shutdown(self) -> None:
        """Release the engine's device side (stops tensor-parallel workers; safe to call twice)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        application: str | None = None,
        schedule: str = "online",
        grouping: str = "first_level",
        module_recompute: str | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs come back in prompt order.

        ``application`` names a pinned system prompt (``LLM(system_prompts={name: text})``) that
        every prompt is put after. ``schedule="batch"`` plans the whole list first (BatchLLM): prompts
        that share a prefix run as one group whose prefix is computed once and held until the group
        ends, groups ordered by Eq. 3; ``grouping`` is ``first_level`` (Algorithm 1) or ``tree``.
        ``module_recompute`` ("none", "link:K", "blend:R") sets Prompt Cache accuracy recovery for the
        PML prompts (a dict prompt's own ``"module_recompute"`` wins; unset: the schema's, else the
        engine's). ``priority``: one per prompt, under ``LLM(scheduling_policy="priority")`` (a
        smaller value starts first), as vLLM's.
        """
        if schedule not in ("online", "batch"):
            raise ValueError(f"schedule {schedule!r} is not one of online, batch")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given: pass a prompt or a non-empty list of prompts")
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts")
        prompts = self._tokenize_texts(prompts)
        order: list[str] = []
        queue = schedule == "online"
        try:
            for prompt, p, rank in zip(prompts, params, priorities, strict=True):
                order.append(
                    self._add(
                        prompt,
                        p,
                        application=application,
                        queue=queue,
                        module_recompute=module_recompute,
                        priority=rank,
                    )
                )
            if not queue:
                queue_groups(self.engine, [self.engine.requests[r] for r in order], grouping)
        except Exception:
            for request_id in order:  # nothing half-queued stays behind
                self.engine.abort(request_id, report=False)
            raise
        done = {out.request_id: out for out in self._run(len(order), use_tqdm)}
        return [done[r] for r in order]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
        application: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order (``PoolingParams``: "last" token or "mean"
        pooling of the final hidden states, L2-normalized by default). Prompts sharing a prefix
        compute it once, as generation's do."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = self._tokenize_texts(list(prompts))
        if not prompts:
            raise ValueError("no prompts given: pass a prompt or a non-empty list of prompts")
        pooling = pooling_params or PoolingParams()
        order: list[str] = []
        try:
            for prompt in prompts:
                order.append(self._add(prompt, None, application=application, pooling=pooling))
        except Exception:
            for request_id in order:
                self.engine.abort(request_id, report=False)
            raise
        done = {out.request_id: out for out in self._run(len(order), use_tqdm)}
        return [embedding_output(done[r]) for r in order]

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` for an embedding model: each pair's cosine similarity of its two
        embeddings (one text against each of the other side's, or the sides pair by pair; a
        bi-encoder, as the server's /score). Every text is embedded in one batch, so texts sharing a
        prefix compute it once."""
        first = [data_1] if isinstance(data_1, str | dict) else list(data_1)
        second = [data_2] if isinstance(data_2, str | dict) else list(data_2)
        pairs = score_pairs(len(first), len(second))
        vectors = self.embed([*first, *second], pooling_params, use_tqdm)
        stacked = torch.tensor([v.outputs.embedding for v in vectors], dtype=torch.float64)
        unit = torch.nn.functional.normalize(stacked, dim=1)
        out = []
        for a, b in pairs:
            one, other = vectors[a], vectors[len(first) + b]
            out.append(
                ScoringRequestOutput(
                    f"{one.request_id}_{other.request_id}",
                    [*one.prompt_token_ids, *other.prompt_token_ids],
                    ScoringOutput(float(unit[a] @ unit[len(first) + b])),
                )
            )
        return out

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        application: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``, a Jinja template's text, as vLLM's)
        to one conversation or a list of them, then generate.

        With ``application``, conversations without a system message get that application's pinned
        system prompt, so they reuse its precomputed KV. A conversation whose first message is a
        Prompt Cache ``<prompt schema="...">`` document runs over that schema's modules, its later
        messages following as turns (``add_generation_prompt`` does not apply: see
        docs/guides/prompt-cache.md, "Chat models").
        ``continue_final_message`` (with ``add_generation_prompt=False``) leaves the last message open,
        so the model goes on with it; ``chat_template_kwargs`` are more variables for the template;
        ``tools`` (OpenAI's function tools, as vLLM's ``LLM.chat`` takes them) go to the template, which
        renders them as it does (the output's calls are the model's text: parse them as you need).
        """
        if not messages:
            raise ValueError("no messages given")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        if application is not None:
            if application not in self.engine.config.system_prompts:
                known = sorted(self.engine.system_prompt_kv)
                raise ValueError(f"unknown application {application!r}; known: {known}")
            if any(c and is_pml_prompt(str(c[0].get("content") or "")) for c in conversations):  # type: ignore[union-attr]
                raise ValueError("a conversation opening with a <prompt> document takes no application")
        pinned = None if application is None else self.engine.config.system_prompts[application]
        prompts: list[Prompt] = []
        for c in conversations:
            first = c[0] if c and isinstance(c[0], dict) else {}
            system = pinned  # put in front of a chat without its own system message, and only there
            if system is not None and not opens_own_system(
                str(first.get("role")), str(first.get("content") or "")
            ):
                c = [{"role": "system", "content": system}, *c]  # type: ignore[list-item]
            else:
                system = None
            text = self.render_chat(
                c,  # type: ignore[arg-type]
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
                chat_template,
                tools,
            )
            leads = opens_with_pinned(self.engine.tokenizer, text, system)
            prompts.append({"prompt": text, "application": application if leads else None})
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- Prompt Cache ------------------------------------------------------------------------
    def register_schema(
        self,
        pml: str,
        encode: bool = True,
        pin: bool = False,
        replace: bool = False,
        module_recompute: str | None = None,
    ) -> str:
        """Register a PML schema (Prompt Cache); returns its name. Its modules are encoded now
        (``encode=False``: at first use) and reused by every ``<prompt schema="...">`` prompt given to
        ``generate`` or ``stream``; ``pin`` keeps them in GPU memory for good. ``module_recompute``
        is the schema's accuracy-recovery setting ("none", "link:K", "blend:R"; requests may override)."""
        return self.engine.register_schema(
            pml, encode=encode, pin=pin, replace=replace, module_recompute=module_recompute
        )

    def unregister_schema(self, name: str) -> None:
        self.engine.unregister_schema(name)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``Engine.reset_prefix_cache``): later prompts compute their tokens
        again. Pins stay. True unless requests were still in the engine."""
        return self.engine.reset_prefix_cache()

    def schemas(self) -> list[dict[str, Any]]:
        """The registered schemas: name, modules, positions spanned, pieces and their tokens."""
        return self.engine.list_schemas()

    def batch(
        self, path_in: str | Path, path_out: str | Path, grouping: str = "first_level", progress: bool = True
    ) -> dict[str, Any]:
        """Answer an OpenAI Batch input file (JSONL) into ``path_out`` as the server would answer each
        row, grouped by shared prefix; a second call with the same paths resumes where one stopped."""
        from prefixserve.entrypoints.batch_runner import run_batch_file  # pydantic: the server's parsing

        return run_batch_file(self.engine, path_in, path_out, grouping, progress)

    def render_chat(
        self,
        conversation: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as prompt text: through the chat template (``chat_template``, else the
        model's), or one PML prompt when it opens with a ``<prompt>`` document."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message needs add_generation_prompt=False (the last message goes on)"
            )
        for m in conversation:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        pml = chat_as_pml(conversation)  # type: ignore[arg-type]
        if pml is not None:
            if continue_final_message or chat_template_kwargs or chat_template or tools:
                raise ValueError("a conversation opening with a <prompt> document is not templated")
            return pml
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template: pass prompt_token_ids")
        extra = dict(chat_template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if tools is not None:
            extra["tools"] = tools
        return self.engine.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best outputs by beam search
        (``sampling/beam_search.py``), best first. Each step runs every live beam as a one-token
        request, whose prompt and shared prefix come from the prefix cache. A sequence's ``text`` is
        its output's (vLLM's holds the prompt's too); ``tokens`` holds the prompt and the output."""
        from tqdm.auto import tqdm

        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given: pass a prompt or a non-empty list of prompts")
        ids = [self._beam_prompt(p) for p in prompts]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        context = self.engine.max_model_len
        for prompt in ids:
            check_context(len(prompt), params.max_tokens, context)
        rooms = [params.max_tokens or context - len(prompt) for prompt in ids]
        search = BeamSearch(ids, params, self.engine.eos_ids, rooms)
        step = params.step_params()
        with tqdm(desc="beam search", disable=not use_tqdm, unit="step") as bar:
            while not search.done:
                beams = [{"prompt_token_ids": t, "cache_salt": salts[i]} for i, t in search.pending()]
                search.advance([top_candidates(out) for out in self.generate(beams, step)])
                bar.update(1)
        results = search.results()
        for best in results:
            with_text(best, self.engine.tokenizer, params)
        return [BeamSearchOutput(best) for best in results]

    def _beam_prompt(self, prompt: Prompt) -> list[int]:
        """A beam search prompt's token ids (a text encoded as ``generate`` encodes it)."""
        if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise TypeError(
                f"a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r:.80}"
            )
        if self.engine.is_pml_prompt(text):
            raise ValueError("beam search takes plain prompts, not Prompt Cache (PML) prompts")
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: give beam search prompt_token_ids")
        return encode_prompt(self.engine.tokenizer, text)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that moved it (for interactive use)."""
        request_id = self._add(prompt, sampling_params or self.get_default_sampling_params(), stream=True)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if request_id in self.engine.requests:
                self.engine.abort(request_id, report=False)
            self.engine.drain()  # a step launched ahead of its last token: completed, nothing in flight

    # ---- internals -----------------------------------------------------------------------------
    def _params_per_prompt(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return params

    def _tokenize_texts(self, prompts: list[Prompt]) -> list[Prompt]:
        """Plain text prompts become ``{"prompt", "prompt_token_ids"}`` dicts, tokenized in one batch
        call: a fast tokenizer encodes a batch on all cores, where one ``encode`` per prompt keeps
        one core busy (256 chats with an 8K-token system prompt: seconds before the first step).
        So do dicts of a text ``prompt`` without ids (``chat``'s); PML prompts pass through unchanged."""
        tok = self.engine.tokenizer
        texts = {
            i: p if isinstance(p, str) else p.get("prompt")
            for i, p in enumerate(prompts)
            if isinstance(p, str) or (isinstance(p, dict) and p.get("prompt_token_ids") is None)
        }
        texts = {i: t for i, t in texts.items() if isinstance(t, str) and not self.engine.is_pml_prompt(t)}
        if tok is None or len(texts) < 2:
            return prompts
        ids = encode_prompts(tok, list(texts.values()))
        out = list(prompts)
        for (i, text), token_ids in zip(texts.items(), ids, strict=True):
            given = prompts[i] if isinstance(prompts[i], dict) else {}
            out[i] = {**given, "prompt": text, "prompt_token_ids": token_ids}  # type: ignore[dict-item]
        return out

    def _add(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        stream: bool = False,
        application: str | None = None,
        queue: bool = True,
        module_recompute: str | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
    ) -> str:
        request_id = str(next(self._ids))
        if isinstance(prompt, str):
            self.engine.add_request(
                request_id,
                prompt,
                params,
                stream=stream,
                application=application,
                queue=queue,
                module_recompute=module_recompute,
                priority=priority,
                pooling=pooling,
            )
        elif isinstance(prompt, dict):
            self.engine.add_request(
                request_id,
                prompt.get("prompt"),
                params,
                prompt_token_ids=prompt.get("prompt_token_ids"),
                prompt_positions=prompt.get("positions"),
                cache_salt=prompt.get("cache_salt"),
                public_tokens=prompt.get("public_tokens", 0),
                tenant=prompt.get("tenant"),
                stream=stream,
                application=prompt.get("application", application),
                queue=queue,
                module_recompute=prompt.get("module_recompute", module_recompute),
                priority=priority,
                pooling=pooling,
            )
        else:
            raise TypeError(f"a prompt is a string or a dict, got {type(prompt).__name__}")
        return request_id

    def _run(self, count: int, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: list[RequestOutput] = []
        with tqdm(total=count, desc="generating", disable=not use_tqdm, unit="req") as bar:
            while len(finished) < count:
                for out in self.engine.step():
                    if out.finished:
                        out.decode_logprob_tokens(self.engine.tokenizer)  # vLLM's decoded_token
                        finished.append(out)
                        bar.update(1)
                if not self.engine.scheduler.has_work() and len(finished) < count:
                    raise RuntimeError("engine stopped with requests unfinished")  # a bug guard
        self.engine.drain()  # a step launched ahead of the last tokens: completed, nothing in flight
        return finished
