"""Request intake: a caller's prompt (text, ids, a PML document, an application's pinned prefix) to a
checked ``Request`` with its first sequence, or a ValueError naming the problem.

As vLLM v1's ``input_processor.py``: everything about a request is decided here, before the engine
queues it, so a refused request leaves nothing behind (a PML prompt's module blocks are given back).
The features a request asks of its sampling (a grammar, bad words, a thinking budget) are its request
rules': each may refuse the params (``RuleSet.check``) and makes its state once the prompt's tokens
are known (``RuleSet.admit``); this module names none of them.
"""

from __future__ import annotations

import hashlib
import numbers
from array import array
from collections.abc import Iterable
from typing import Any

from prefixserve.engine.prompt_tokens import behind_pinned, encode_prompt, keep_last
from prefixserve.engine.system_prompts import SystemPromptKV
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.promptcache.recompute import parse_recompute
from prefixserve.promptcache.store import ModulePrompt, PromptModules
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.rules import RuleSet
from prefixserve.sequence import HeldModules, Request, Sequence, TokenArray, counting_positions, token_array
from prefixserve.worker.model_runner import ModelRunner


def int_list(values: Any, name: str) -> list[Any]:
    """A caller's ids or positions as a list: arrays, numpy arrays and tensors through ``tolist`` (plain
    ints at C speed, which the checks after it take fast); text, bytes and scalars refused by name."""
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of integers, not {type(values).__name__}")
    return values.tolist() if hasattr(values, "tolist") else list(values)


def valid_token_ids(tokens: list[int], vocab: int) -> bool:
    """All ids integers in [0, vocab). Plain ints are checked at C speed (type set, min, max): a
    per-token generator cost about a millisecond per 8K-token prompt on the server's engine thread."""
    if not tokens:
        return True
    if set(map(type, tokens)) == {int}:
        return min(tokens) >= 0 and max(tokens) < vocab
    return all((type(t) is int or isinstance(t, numbers.Integral)) and 0 <= t < vocab for t in tokens)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of a request's sample ``index``: a digest of both, so that no two (seed,
    index) pairs meet (Python's ``hash`` of ints folds them modulo 2**61 - 1: seed 2**64 - 1 drew
    what seed 7 did)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def check_context(
    num_tokens: int, max_tokens: int | None, max_model_len: int, generates: bool = True
) -> None:
    """Refuse a prompt (or a ``max_tokens``) the context cannot hold: a ValueError naming the numbers.
    The server asks it before its overload gate too, so a request that can never run is a 400 and
    not a 429 to retry. A request that generates nothing (an embedding: ``generates`` False) may fill
    the whole context, as vLLM's may; its one internal token is never run."""
    if not generates:
        if num_tokens > max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens, over the context length of {max_model_len}"
            )
        return
    if num_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_tokens} tokens, over the context length of {max_model_len} "
            "(leaving room for at least one generated token)"
        )
    room = max_model_len - num_tokens
    if max_tokens is not None and max_tokens > room:
        raise ValueError(
            f"max_tokens={max_tokens} does not fit: the prompt has {num_tokens} tokens and the "
            f"context length is {max_model_len}, so at most {room} tokens can be generated"
        )


class InputProcessor:
    """Validates prompts against the model and the context and makes their requests and sequences.

    The tokenizer and the context length are passed per call: callers may swap the engine's
    tokenizer, and the context shrinks once system prompts are pinned.
    """

    def __init__(
        self,
        runner: ModelRunner,
        modules: PromptModules,
        system_prompt_kv: dict[str, SystemPromptKV],
        requests: dict[str, Request],
        vocab_size: int,
        block_size: int,
        rules: RuleSet | None = None,
    ) -> None:
        self.runner, self.modules, self.requests = runner, modules, requests
        self.system_prompt_kv = system_prompt_kv
        self.vocab_size, self.block_size = vocab_size, block_size
        self.rules = rules if rules is not None else RuleSet(())  # the engine's request rules
        self._next_seq_id = 0

    def process(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | None,
        prompt_token_ids: Iterable[int] | None,
        prompt_positions: Iterable[int] | None,
        cache_salt: str | None,
        stream: bool,
        application: str | None,
        module_recompute: str | None,
        tokenizer: Any,
        max_model_len: int,
        public_tokens: int = 0,
        pooled: bool = False,
    ) -> Request:
        """The checked request, with its first sequence; see ``Engine.add_request`` for the arguments.

        A PML prompt's module blocks are held from here on (by the request, until it ends), or from
        its admission where the pool has no room for them now (``engine/module_holds.py``)."""
        params = params or SamplingParams()
        self.rules.check(params, tokenizer)  # refused, or prepared for (a grammar compiled)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            bad = max(params.logit_bias)
            raise ValueError(f"logit_bias names token id {bad}, not in the vocabulary [0, {self.vocab_size})")
        if params.allowed_token_ids and params.allowed_token_ids[-1] >= self.vocab_size:
            bad = params.allowed_token_ids[-1]
            raise ValueError(
                f"allowed_token_ids names token id {bad}, not in the vocabulary [0, {self.vocab_size})"
            )
        truncate = params.truncate_prompt_tokens
        if truncate is not None and (application is not None or prompt_positions is not None):
            raise ValueError(
                "truncate_prompt_tokens cannot be combined with an application or prompt_positions"
            )
        slots = getattr(self.runner, "state_sequences", 0)  # a hybrid: one state slot a running sample
        if slots and params.num_samples > slots:
            raise ValueError(
                f"n={params.num_samples} samples need as many running sequences, more than the "
                f"{slots} (max_num_seqs) a linear-attention hybrid runs at once"
            )
        if stream and params.num_samples > params.n:
            raise ValueError("best_of > n cannot be streamed (the n best are known only at the end)")
        if module_recompute is not None:
            parse_recompute(module_recompute)  # a bad setting is refused whatever the prompt
        if not isinstance(public_tokens, int) or isinstance(public_tokens, bool) or public_tokens < 0:
            raise ValueError(f"public_tokens must be an integer >= 0, got {public_tokens!r}")
        if public_tokens and cache_salt is None:
            raise ValueError("public_tokens needs a cache_salt (without one every block is shared)")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None and prompt is not None and is_pml_prompt(prompt):
            if application is not None or prompt_positions is not None:
                raise ValueError("a PML prompt takes neither application nor prompt_positions")
            if params.prompt_logprobs is not None or truncate is not None:
                what = "prompt_logprobs are" if truncate is None else "truncate_prompt_tokens is"
                raise ValueError(f"{what} not available for PML (Prompt Cache) prompts")
            # held now, or at admission; public_tokens covering the modules: the schema's pieces unsalted
            mp = self.modules.prepare(prompt, cache_salt, module_recompute, public_tokens)
            try:
                tokens, positions = mp.token_ids, mp.positions
                req = self._request(
                    request_id, prompt, params, tokens, positions, cache_salt, stream, mp, max_model_len,
                    pooled,
                )  # fmt: skip
                self.rules.admit(req, tokenizer)
                return req
            except BaseException:
                self.modules.release(mp.blocks)
                raise
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            prompt_token_ids = encode_prompt(tokenizer, prompt)
        tokens = int_list(prompt_token_ids, "prompt_token_ids")
        if truncate is not None:
            kept = keep_last(tokens, truncate, params.max_tokens, max_model_len)
            prompt, tokens = (prompt, tokens) if len(kept) == len(tokens) else (None, kept)  # text: all of it
        system = None
        if application is not None:
            system = self.system_prompt_kv.get(application)
            if system is None:
                known = sorted(self.system_prompt_kv)
                raise ValueError(f"unknown application {application!r}; known: {known}")
            if tokens[: len(system.token_ids)] != system.token_ids:
                if prompt_positions is not None:
                    raise ValueError("prompt_positions cannot be combined with an application prefix")
                tokens = behind_pinned(system.token_ids, tokens, tokenizer)
        req = self._request(
            request_id, prompt, params, tokens, prompt_positions, cache_salt, stream, None, max_model_len,
            pooled,
        )  # fmt: skip
        req.public_tokens = min(public_tokens, len(tokens))
        # the pinned prompt's blocks are unsalted: this prompt's first ones where no salt covers them
        unsalted = system is not None and (cache_salt is None or req.public_tokens >= len(system.token_ids))
        if system is not None and prompt_positions is None and unsalted:
            # the pinned blocks' digests are this prompt's first ones: not hashed again (512 per 8K prompt)
            req.sequences[0].block_digests = list(system.digests)
        self.rules.admit(req, tokenizer)
        return req

    def _request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        tokens: list[int] | TokenArray,
        prompt_positions: Iterable[int] | None,
        cache_salt: str | None,
        stream: bool,
        modules: ModulePrompt | None,
        max_model_len: int,
        pooled: bool = False,
    ) -> Request:
        """Check a prompt's tokens against the model and the context, then make the request
        (``pooled``: an embedding's, which generates nothing)."""
        if not tokens:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        # a PML prompt's module rows (and holes' placeholders) came from the store: own ones only
        check = tokens[modules.module_slots :] if modules is not None else tokens
        if not valid_token_ids(check, vocab):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), as integers")
        check_context(len(tokens), params.max_tokens, max_model_len, generates=not pooled)
        if prompt_positions is None:
            positions = counting_positions(len(tokens))
        elif isinstance(prompt_positions, array) and prompt_positions.typecode == "q":
            positions = token_array(prompt_positions)  # a copy at C speed (a PML prompt's, from the store)
        else:
            try:
                positions = token_array(int_list(prompt_positions, "prompt_positions"))
            except (TypeError, OverflowError):
                raise ValueError("prompt_positions must be integers (int64)") from None
        if len(positions) != len(tokens):
            raise ValueError("prompt_positions must have one position per prompt token")
        ids = token_array(tokens)
        req = Request(request_id, prompt, ids, positions, params, cache_salt, stream=stream)
        if modules is not None:
            req.modules = HeldModules(
                blocks=modules.blocks, digests=modules.digests, holes=modules.holes,
                tokens=modules.module_tokens, recomputed_tokens=modules.recomputed_tokens,
                private_rows=modules.private_rows, recompute_runs=modules.recompute_runs,
                runs=list(modules.recompute_runs), keys=modules.keys, private=modules.private,
                let_go=modules.let_go,
            )  # fmt: skip
            req.num_cached_tokens = req.modules.reused_tokens
        self.new_sequence(req, 0, ids[:], positions[:])  # copies of the arrays (C speed, no re-typing)
        return req

    def new_sequence(
        self, req: Request, index: int, tokens: TokenArray, positions: TokenArray, samples: bool = True
    ) -> Sequence:
        """Sample ``index`` of ``req`` (the first at intake, the others when n > 1 samples fork);
        ``samples=False``: one that ends before it samples (no generator, no device touched)."""
        seq = Sequence(self._next_seq_id, req, index, tokens, positions)
        seq.block_digests = list(req.modules.digests) if req.modules is not None else []
        self._next_seq_id += 1
        if req.params.seed is not None and samples:
            seed = sample_seed(req.params.seed, index)
            seq.generator = self.runner.make_generator(seed)
        req.sequences.append(seq)
        return seq


__all__ = ["InputProcessor", "check_context", "int_list", "valid_token_ids"]
