"""After a token lands: does the sequence stop (EOS, stop ids, stop strings, length)?

Pure functions of a sequence and the tokenizer (which may be None: then texts stay ""), as vLLM v1's
``sched/utils.py`` keeps its stop checks: the scheduler decides *when* to call them, after it puts a
sampled token in place (``Scheduler.update_from_output``). The tokenizer is passed per call because
callers may swap the engine's tokenizer at run time.
"""

from __future__ import annotations

from typing import Any

from prefixserve.sequence import Sequence


def stop_reason(seq: Sequence, eos_ids: set[int], max_model_len: int, tokenizer: Any) -> str | None:
    """The finish reason of ``seq`` after its last token ("stop" or "length"), or None to go on.

    Sets ``seq.stop_reason`` (the stop token id or string, None for EOS) and, for a stop string,
    ``seq.output_text`` (the text cut there).
    """
    p = seq.request.params
    token = seq.token_ids[-1]
    out_len = seq.num_tokens - seq.num_prompt_tokens
    stops = _stops_count(p, out_len)
    reason: str | None = None
    if stops and not p.ignore_eos and token in eos_ids:
        reason, seq.stop_reason = "stop", None
    elif stops and token in p.stop_token_ids:
        reason, seq.stop_reason = "stop", token
    elif p.stop and out_len > p.min_tokens and _hit_stop_string(seq, tokenizer):
        reason = "stop"
    elif ends_by_length(seq, max_model_len):
        reason = "length"
    return reason


def stop_possible(seq: Sequence, eos_ids: set[int], max_model_len: int) -> bool:
    """False only where ``stop_reason`` surely returns None and touches nothing, so a caller may skip
    it: its branches in the same order, with the stop-string search replaced by "there are stop
    strings" (the search is its only side effect: the detokenizer's update)."""
    if ends_by_length(seq, max_model_len):
        return True
    p = seq.request.params
    if not _stops_count(p, seq.num_tokens - seq.num_prompt_tokens):
        return False
    token = seq.token_ids[-1]
    return (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids or bool(p.stop)


def _stops_count(p: Any, out_len: int) -> bool:
    """Past min_tokens stops count; under a grammar always: it ends the output where it must (its EOS
    is never banned, ``sampling/min_tokens.py``), and a swallowed EOS would leave what follows free."""
    return out_len > p.min_tokens or p.structured_outputs is not None


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """The sequence's last token (known or still in flight) is its last: max_tokens or the context."""
    cap = seq.request.params.max_tokens
    out_len = seq.num_tokens - seq.num_prompt_tokens
    return seq.num_tokens >= max_model_len or (cap is not None and out_len >= cap)


def _hit_stop_string(seq: Sequence, tokenizer: Any) -> bool:
    if tokenizer is None:  # no tokenizer: the text stays "", which holds no (non-empty) stop
        return False
    # Called after every appended token past min_tokens until a stop string shows up, so only the new
    # text and the longest stop's length - 1 characters before it are searched: O(new tokens) per step.
    # The first call leaves the text of the min_tokens tokens out (vLLM searches only new text), so
    # a stop string counts only where it ends in text generated past them.
    min_tokens = seq.request.params.min_tokens
    if min_tokens and (seq.detokenizer is None or seq.detokenizer.num_ids <= min_tokens):
        seq.detokenize(tokenizer, upto=min_tokens).skip_search()
    detok = seq.detokenize(tokenizer)
    hit = detok.find_first(seq.request.params.stop or [])  # the earliest, as in the text searched
    if hit is None:
        return False
    at, stop = hit
    keep = at + len(stop) if seq.request.params.include_stop_str_in_output else at
    seq.output_text = detok.full_text[:keep]
    seq.stop_reason = stop
    return True


__all__ = ["ends_by_length", "stop_possible", "stop_reason"]
