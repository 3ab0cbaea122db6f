"""What is reported of a request: its samples' texts, and the ``RequestOutput`` callers see.

Pure functions of a sequence or request and the tokenizer (which may be None: then texts stay ""), so
the engine loop only decides *when* to call them; whether a sequence stops is the scheduler's
(``scheduler/stop.py``). The tokenizer is passed per call because callers may swap the engine's
tokenizer at run time.
"""

from __future__ import annotations

from typing import Any

from prefixserve.detokenizer import decode_output
from prefixserve.engine.output_rules import OutputRules
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sequence import Request, Sequence


def output_text(seq: Sequence, tokenizer: Any) -> str:
    """The output's text, as ``decode(output ids, skip_special_tokens=...)`` gives it (the request's
    ``skip_special_tokens``, True by default).

    Incremental: the sequence's detokenizer decodes only what was appended since the last call.
    """
    if tokenizer is None:
        return ""
    return seq.detokenize(tokenizer).full_text


def sample_text(seq: Sequence, tokenizer: Any) -> str:
    """What a sample's output says of its text now, as vLLM's detokenizer answers:

    * finished on a stop string: the text cut there (``stop.py``);
    * finished on EOS or a stop token id: the text of the tokens before it, unless
      ``include_stop_str_in_output`` (the stop token's own text, if it has one, is left out);
    * otherwise finished: the decode of all its tokens;
    * still running (streamed): the settled text (no half-received character) less the longest stop
      string's length - 1 characters, which may yet turn out to start a stop string and be cut; each
      streamed text is then a prefix of the next and of the final one.
    """
    if isinstance(seq.stop_reason, str):
        return seq.output_text
    p = seq.request.params
    if tokenizer is None or not p.detokenize:  # vLLM's detokenize=False: token ids alone
        return ""
    if seq.is_finished:
        if seq.finish_reason != "stop" or p.include_stop_str_in_output:
            return output_text(seq, tokenizer)
        before = seq.num_tokens - seq.num_prompt_tokens - 1  # the tokens before the stop token
        detok = seq.detokenizer
        if detok is not None and detok.num_ids > before:  # fed past it already: decode afresh
            ids = seq.output_token_ids[:before]
            return decode_output(tokenizer, seq.prompt_tail(), ids, p.skip_special_tokens)
        return seq.detokenize(tokenizer, upto=before).full_text
    text = seq.detokenize(tokenizer).text
    hold = max(map(len, p.stop), default=1) - 1 if not p.include_stop_str_in_output else 0
    return text[: max(0, len(text) - hold)] if hold else text


def request_output(
    req: Request, tokenizer: Any, finished: bool, rules: OutputRules | None = None
) -> RequestOutput:
    """What the caller sees of a request now: every sample's text, ids, reasons and logprobs, and times;
    the output ``rules`` fill their fields (prompt logprobs, an embedding)."""
    completions = []
    held = req.modules
    for rank, seq in enumerate(_reported(req)):
        text = sample_text(seq, tokenizer)
        want_lp = req.params.logprobs is not None
        ranked = req.params.num_samples > req.params.n
        completions.append(
            CompletionOutput(
                index=rank if ranked else seq.index,
                text=text,
                token_ids=seq.output_token_ids,  # a fresh slice: no second copy
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                token_logprobs=list(seq.output_logprobs) if want_lp else None,
                top_logprobs=list(seq.output_top_logprobs) if want_lp else None,
                cumulative_logprob=sum(seq.output_logprobs) if want_lp or ranked else None,
            )
        )
    fields = rules.report(req, finished) if rules is not None else {}
    times = {"arrival_time": req.arrival_time}
    if req.scheduled_time is not None:
        times["scheduled_time"] = req.scheduled_time
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
        num_recomputed_tokens=held.recomputed_tokens if held else 0,
        module_rows_shared=held.tokens - held.private_rows if held else 0,
        module_rows_private=held.private_rows if held else 0,
        metrics=times,
        error=req.error,
        cache_written_tokens=req.cache_written_tokens,
        cache_pins_refused=req.cache_pins_refused,
        **fields,
    )


def _reported(req: Request) -> list[Sequence]:
    """The samples reported: all of them, or with ``best_of`` > n the n of highest cumulative logprob
    (ties: the lower index), ranked."""
    p = req.params
    if p.num_samples == p.n:
        return req.sequences
    ranked = sorted(req.sequences, key=lambda s: (-sum(s.output_logprobs), s.index))
    return ranked[: p.n]


__all__ = ["output_text", "request_output", "sample_text"]
