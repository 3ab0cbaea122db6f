"""After a token lands: does the sequence stop (EOS, stop ids, stop strings, length), and what is reported.

Pure functions of a sequence or request and the tokenizer (which may be None: then texts stay ""), so
the engine loop only decides *when* to call them. The tokenizer is passed per call because callers may
swap the engine's tokenizer at run time.
"""

from __future__ import annotations

from typing import Any

from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sequence import Request, Sequence


def stop_reason(seq: Sequence, eos_ids: set[int], max_model_len: int, tokenizer: Any) -> str | None:
    """The finish reason of ``seq`` after its last token ("stop" or "length"), or None to go on.

    Sets ``seq.stop_reason`` (the stop token id or string, None for EOS) and, for a stop string,
    ``seq.output_text`` (the text cut there).
    """
    p = seq.request.params
    token = seq.token_ids[-1]
    out_len = seq.num_tokens - seq.num_prompt_tokens
    reason: str | None = None
    if out_len > p.min_tokens and not p.ignore_eos and token in eos_ids:
        reason, seq.stop_reason = "stop", None
    elif out_len > p.min_tokens and token in p.stop_token_ids:
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
    if seq.num_tokens - seq.num_prompt_tokens <= p.min_tokens:
        return False
    token = seq.token_ids[-1]
    return (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids or bool(p.stop)


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """The sequence's last token (known or still in flight) is its last: max_tokens or the context."""
    cap = seq.request.params.max_tokens
    out_len = seq.num_tokens - seq.num_prompt_tokens
    return seq.num_tokens >= max_model_len or (cap is not None and out_len >= cap)


def _hit_stop_string(seq: Sequence, tokenizer: Any) -> bool:
    if tokenizer is None:  # no tokenizer: the text stays "", which holds no (non-empty) stop
        return False
    # Called after every appended token until a stop string shows up, so only the new text and the
    # longest stop's length - 1 characters before it are searched: O(new tokens) per step.
    detok = seq.detokenize(tokenizer)
    hit = detok.find_first(seq.request.params.stop or [])  # the earliest, as in the full text
    if hit is None:
        return False
    at, stop = hit
    keep = at + len(stop) if seq.request.params.include_stop_str_in_output else at
    seq.output_text = detok.full_text[:keep]
    seq.stop_reason = stop
    return True


def output_text(seq: Sequence, tokenizer: Any) -> str:
    """The output's text, as ``decode(output ids, skip_special_tokens=True)`` gives it.

    Incremental: the sequence's detokenizer decodes only what was appended since the last call.
    """
    if tokenizer is None:
        return ""
    return seq.detokenize(tokenizer).full_text


def request_output(req: Request, tokenizer: Any, finished: bool) -> RequestOutput:
    """What the caller sees of a request now: every sample's text, ids, reasons and logprobs, and times."""
    completions = []
    for seq in req.sequences:
        text = seq.output_text if isinstance(seq.stop_reason, str) else output_text(seq, tokenizer)
        want_lp = req.params.logprobs is not None
        completions.append(
            CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=seq.output_token_ids,  # a fresh slice: no second copy
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
        prompt_token_ids=req.reported_prompt_token_ids,  # one list per request, shared by its outputs
        outputs=completions,
        finished=finished,
        num_cached_tokens=req.num_cached_tokens,
        num_recomputed_tokens=req.num_recomputed_tokens,
        module_rows_shared=req.num_module_tokens - req.num_private_module_rows,
        module_rows_private=req.num_private_module_rows,
        metrics=times,
    )


__all__ = ["ends_by_length", "output_text", "request_output", "stop_possible", "stop_reason"]
