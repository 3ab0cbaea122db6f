"""Engine outputs -> OpenAI JSON: full responses, stream chunks, logprobs and usage.

Streaming sends text deltas, holding back two kinds of tail until they settle, so that the chunks
always concatenate to the final (non-streamed) text: an incomplete UTF-8 character (decoded as
U+FFFD) and a suffix that might be the start of a stop string (the stop string is cut later).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring  # a str as a JSON string (non-ASCII kept), in C
from typing import Any

from prefixserve.outputs import CompletionOutput, RequestOutput

TokenText = Callable[[int], str]
DONE = "data: [DONE]\n\n"  # a completion or chat stream's last event


def _lp(x: float) -> float:
    """JSON has no -inf: a token of probability 0 gets OpenAI's floor of -9999."""
    return x if math.isfinite(x) else -9999.0


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(f.num_prompt_tokens for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)},
    }


def completion_logprobs(
    c: CompletionOutput, start: int, end: int, token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """Legacy completions shape: parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens = [token_text(t) for t in c.token_ids[start:end]]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    lps = (c.token_logprobs or [])[start:end]
    tops = (c.top_logprobs or [])[start:end]
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(x) for x in lps],
        "top_logprobs": [
            _top_with(top, t, lp, token_text)
            for top, t, lp in zip(tops, c.token_ids[start:end], lps, strict=False)
        ],
        "text_offset": offsets,
    }


def _top_with(top: list[tuple[int, float]], token: int, logprob: float, token_text: TokenText) -> dict:
    """A legacy ``top_logprobs`` entry: the top alternatives, and the chosen token's own logprob where
    it is not among them ("up to logprobs + 1 elements", as OpenAI and vLLM answer)."""
    entry = {token_text(t): _lp(lp) for t, lp in top}
    if all(t != token for t, _ in top):
        entry.setdefault(token_text(token), _lp(logprob))
    return entry


def token_bytes(token_text: TokenText, token_id: int) -> list[int]:
    """Chat logprobs' ``bytes`` of a token: its own bytes where ``token_text`` knows them (``raw``: a
    token holding part of a character, whose text alone is U+FFFD), else its text's UTF-8."""
    raw = getattr(token_text, "raw", None)
    return list(raw(token_id) if raw is not None else token_text(token_id).encode("utf-8", "replace"))


def chat_logprobs(c: CompletionOutput, start: int, end: int, token_text: TokenText) -> dict[str, Any]:
    """Chat shape: one entry per token with its bytes and its top alternatives."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        return {"token": token_text(tid), "logprob": _lp(lp), "bytes": token_bytes(token_text, tid)}

    content = []
    lps = c.token_logprobs or []
    tops = c.top_logprobs or []
    for i in range(start, min(end, len(lps))):
        item = entry(c.token_ids[i], lps[i])
        item["top_logprobs"] = [entry(t, lp) for t, lp in (tops[i] if i < len(tops) else [])]
        content.append(item)
    return {"content": content}


def prompt_completion_logprobs(
    f: RequestOutput, token_text: TokenText, k: int | None = None, skip: int = 0
) -> dict[str, Any]:
    """The prompt's part of an echoed choice's logprobs (its ``k`` top ones) from prompt token ``skip``
    on (before it: a pinned prompt the client did not send); the prompt's first token has none."""
    ids = f.prompt_token_ids[skip:]
    lps, tops = (f.prompt_token_logprobs or [])[skip:], (f.prompt_top_logprobs or [])[skip:]
    tokens = [token_text(t) for t in ids]
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if x is None else _lp(x) for x in lps],
        "top_logprobs": [
            None if x is None else _top_with(top[:k] if k is not None else top, t, x, token_text)
            for top, t, x in zip(tops, ids, lps, strict=False)
        ],
        "text_offset": offsets,
    }


def prompt_logprobs(
    f: RequestOutput, k: int, token_text: TokenText, skip: int = 0
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token from ``skip`` on (the prompt's first: None), its own
    logprob and rank and the ``k`` top ones (ranks 1..k), keyed by token id."""
    lps, tops = f.prompt_token_logprobs or [], f.prompt_top_logprobs or []
    ranks = f.prompt_logprob_ranks or []
    out: list[dict[str, Any] | None] = []
    for token, lp, top, rank in zip(
        f.prompt_token_ids[skip:], lps[skip:], tops[skip:], ranks[skip:], strict=False
    ):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": _lp(lp), "rank": rank, "decoded_token": token_text(token)}}
        for r, (t, v) in enumerate(top[:k], start=1):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": r, "decoded_token": token_text(t)})
        out.append(entry)
    return out


def without_completion(f: RequestOutput) -> RequestOutput:
    """The output with its samples' tokens taken out (echo with max_tokens 0 answers the prompt alone)."""
    outs = [
        replace(c, text="", token_ids=[], token_logprobs=[], top_logprobs=[], finish_reason="length")
        for c in f.outputs
    ]
    return RequestOutput(*f._args()[:3], outs, *f._args()[4:])


def completion_body(
    rid: str,
    model: str,
    finals: list[RequestOutput],
    n: int,
    token_text: TokenText,
    want_logprobs: bool,
    echoed: list[str] | None = None,
    echo_k: int | None = None,
    skips: list[int] | None = None,
) -> dict[str, Any]:
    """``echoed``: each prompt's text, put before its choices' texts (echo), with the prompt's logprobs
    (``echo_k`` top ones; from prompt token ``skips[p]`` on) before theirs."""
    choices = []
    for p, f in enumerate(finals):
        head = echoed[p] if echoed is not None else ""
        prompt_lp = (
            prompt_completion_logprobs(f, token_text, echo_k, skips[p] if skips else 0)
            if echoed is not None and want_logprobs
            else None
        )
        for c in f.outputs:
            lp = None
            if want_logprobs:
                start = sum(map(len, prompt_lp["tokens"])) if prompt_lp else 0
                lp = completion_logprobs(c, 0, len(c.token_ids), token_text, start)
                if prompt_lp is not None:
                    lp = {key: prompt_lp[key] + lp[key] for key in lp}
            choices.append(
                {
                    "index": p * n + c.index,
                    "text": head + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            )
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(finals),
    }


def chat_body(
    rid: str, model: str, final: RequestOutput, token_text: TokenText, want_logprobs: bool
) -> dict[str, Any]:
    choices = []
    for c in final.outputs:
        lp = chat_logprobs(c, 0, len(c.token_ids), token_text) if want_logprobs else None
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([final]),
    }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class _Choice:
    chars: int = 0  # text characters sent
    tokens: int = 0  # tokens whose logprobs were sent
    offset: int = 0  # text_offset for completions logprobs
    done: bool = False
    led: bool = False  # the echoed prompt went out (completions' echo)


# completions' echo, streamed: a prompt's text and, where logprobs are asked, its tokens' logprobs
# (``prompt_completion_logprobs``), which lead each of its choices' first chunk (by prompt index)
EchoLead = Callable[[int, RequestOutput], tuple[str, dict[str, Any] | None]]


@dataclass
class StreamState:
    """Turns successive cumulative outputs into deltas, per choice; one per streamed HTTP request.

    A stream sends one chunk per token per choice, so a chunk's JSON is built from two strings made
    once per stream (``id``, ``object``, ``created``, ``model`` before the choices; ``usage`` after)
    around its one choice; a plain choice (no logprobs) is written without building a dict.
    """

    rid: str
    model: str
    chat: bool
    n: int
    token_text: TokenText
    stop: list[str]
    want_logprobs: bool
    include_usage: bool
    echo: str = ""  # a chat's echo: the role chunks' content (the last assistant message, vLLM's echo)
    echo_lead: EchoLead | None = None  # completions' echo (vLLM streams it in each choice's first chunk)
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: each chunk its choice's usage so far
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    _head: str = field(init=False, repr=False)
    _tail: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = (
            f'data: {{"id":{encode_basestring(self.rid)},"object":"{obj}","created":{self.created},'
            f'"model":{encode_basestring(self.model)},"choices":['
        )
        self._tail = ("]," + '"usage":null}\n\n') if self.include_usage else "]}\n\n"

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        body = ",".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in choices)
        return self._head + body + self._tail

    def _plain_chunk(self, index: int, delta: str, finish: str | None) -> str:
        """One choice without logprobs, as ``chunk`` writes it, without a dict or the JSON encoder."""
        reason = "null" if finish is None else encode_basestring(finish)
        if self.chat:
            content = f'{{"content":{encode_basestring(delta)}}}' if delta else "{}"
            choice = f'{{"index":{index},"delta":{content},"logprobs":null,"finish_reason":{reason}}}'
        else:
            text = encode_basestring(delta)
            choice = f'{{"index":{index},"text":{text},"logprobs":null,"finish_reason":{reason}}}'
        return self._head + choice + self._tail

    def opening(self) -> list[str]:
        """What the stream sends before its first output's: a chat's role chunks."""
        return self.role_chunks() if self.chat else []

    def before(self, out: RequestOutput) -> list[str]:
        """What goes before an output's chunks: nothing here; another API's adapter may open its
        answer there (once), whatever part of the state sends the first chunk."""
        return []

    def closing(self, finals: list[RequestOutput]) -> list[str]:
        """What follows the last output's chunks: the usage where asked, and ``[DONE]``."""
        return [self.usage_chunk(finals), DONE] if self.include_usage else [DONE]

    def error_event(self, error: dict[str, Any]) -> str:
        """An error body (``APIError.body()``) sent in place of the rest of the stream, then ``[DONE]``
        (as vLLM ends it: SSE clients wait for it)."""
        return sse(error) + DONE

    def role_chunks(self) -> list[str]:
        """Chat streams open each choice with the assistant role."""
        return [
            self.chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": self.echo},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in range(self.n)
        ]

    def count(self, out: RequestOutput, c: CompletionOutput) -> None:
        """With continuous usage, the chunks that follow carry ``c``'s usage so far (vLLM's: the
        prompt's tokens and this choice's)."""
        if self.continuous_usage:
            done = len(c.token_ids)
            total = out.num_prompt_tokens + done
            self._tail = (
                f'],"usage":{{"prompt_tokens":{out.num_prompt_tokens},"completion_tokens":{done},'
                f'"total_tokens":{total}}}}}\n\n'
            )

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            state = self.choices.setdefault(index, _Choice())
            if state.done:
                continue
            self.count(out, c)
            upto = len(c.text) if c.finished else self._settled(c.text)
            upto = max(upto, state.chars)
            delta = c.text[state.chars : upto]
            end = len(c.token_logprobs or []) if self.want_logprobs else state.tokens
            leads = self.echo_lead is not None and not state.led
            lead, lead_lp = self.echo_lead(prompt_index, out) if self.echo_lead and leads else ("", None)
            if not delta and end == state.tokens and not c.finished and not leads:
                continue
            state.led = True
            finish = c.finish_reason if c.finished else None
            if self.want_logprobs:
                chunks.append(self._logprobs_chunk(index, c, state, lead + delta, end, finish, lead_lp))
            else:
                chunks.append(self._plain_chunk(index, lead + delta, finish))
            state.chars, state.tokens, state.done = upto, end, c.finished
        return chunks

    def _logprobs_chunk(
        self,
        index: int,
        c: CompletionOutput,
        state: _Choice,
        delta: str,
        end: int,
        finish: str | None,
        lead: dict[str, Any] | None = None,
    ) -> str:
        """A choice with the logprobs of its tokens from ``state.tokens`` to ``end`` (after ``lead``'s,
        an echoed prompt's)."""
        if self.chat:
            lp = chat_logprobs(c, state.tokens, end, self.token_text)
            choice = {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": lp}
        else:
            if lead is not None:
                state.offset = sum(map(len, lead["tokens"]))
            lp = completion_logprobs(c, state.tokens, end, self.token_text, state.offset)
            state.offset += sum(len(t) for t in lp["tokens"])
            if lead is not None:
                lp = {key: lead[key] + lp[key] for key in lp}
            choice = {"index": index, "text": delta, "logprobs": lp}
        choice["finish_reason"] = finish
        return self.chunk([choice])

    def _settled(self, text: str) -> int:
        """Length of the prefix of ``text`` that can no longer change."""
        upto = len(text.rstrip("\ufffd"))
        head, hold = text[:upto], 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, upto), hold, -1):
                if head.endswith(stop[:k]):
                    hold = k
                    break
        return upto - hold

    def usage_chunk(self, finals: list[RequestOutput]) -> str:
        payload = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(finals),
        }
        return sse(payload)
