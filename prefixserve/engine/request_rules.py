"""The engine's rules, assembled: the one place in ``engine/`` that names the features behind them.

Request rules (``sampling/rules.py``) act on a request's sampling; output rules
(``engine/output_rules.py``) on what it reports. The engine's loop and intake call the two sets'
hooks and import no rule's module (``tests/test_request_rules.py`` checks it), so a new feature is
a rule class in its own module plus one line here. Order matters only where hooks short-circuit or
refuse: ``check`` raises the first refusal (a bad grammar before a missing tokenizer, as intake
always refused them), ``waits`` stops at the first rule that waits.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.engine.output_rules import OutputRules
from prefixserve.engine.pooling import Pooler
from prefixserve.engine.prompt_logprobs import PromptLogprobs
from prefixserve.sampling.bad_words import BadWordsRule
from prefixserve.sampling.min_tokens import MinTokensRule
from prefixserve.sampling.penalties import AllowedTokensRule, LogitBiasRule, PenaltiesRule
from prefixserve.sampling.rules import RuleSet
from prefixserve.sampling.thinking_budget import ThinkingBudgetRule
from prefixserve.structured.rule import StructuredOutputsRule

STRUCTURED = StructuredOutputsRule.name  # the rule whose engine-wide part tests and probes inspect


def request_rules(
    eos_ids: set[int],
    vocab_size: int,
    device: torch.device | str,
    max_num_seqs: int,
    reasoning_parser: str | None,
) -> RuleSet:
    """Structured outputs, ``min_tokens``, ``bad_words``, ``thinking_token_budget``, ``logit_bias``,
    ``allowed_token_ids`` and the penalties (their adjusts in that order). ``eos_ids``: the
    engine's set (``min_tokens`` bans them, grammars end on them); ``max_num_seqs`` sizes the masks'
    buffers."""
    return RuleSet(
        [
            StructuredOutputsRule(vocab_size, eos_ids, device, max_num_seqs),
            MinTokensRule(eos_ids),
            BadWordsRule(),
            ThinkingBudgetRule(reasoning_parser),
            LogitBiasRule(),
            AllowedTokensRule(),
            PenaltiesRule(),
        ]
    )


def output_rules(device: torch.device, block_size: int) -> OutputRules:
    """Prompt logprobs (echo, ``prompt_logprobs``) and pooling (embedding requests)."""
    return OutputRules([PromptLogprobs(device, block_size), Pooler(block_size)])


def structured_decoding(rules: RuleSet, tokenizer: Any | None = None) -> Any:
    """Structured decoding's engine-wide part (``structured/decoding.StructuredDecoding``): set up now
    with ``tokenizer`` if given, else as it is (None before the first constrained request)."""
    rule: StructuredOutputsRule = rules.find(STRUCTURED)
    return rule.decoding if tokenizer is None else rule.set_up(tokenizer)


def close_structured(rules: RuleSet) -> None:
    """End structured decoding's matcher process (started with a GPU engine, or at the first request)."""
    rule: StructuredOutputsRule = rules.find(STRUCTURED)
    rule.close()


__all__ = ["STRUCTURED", "close_structured", "output_rules", "request_rules", "structured_decoding"]
