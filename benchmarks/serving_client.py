"""The load generator of ``benchmarks/serving.py --device cuda``: the official ``openai`` client, one process.

Run as ``python -m benchmarks.serving_client`` (no torch, no prefixserve import): it reads one job a line
on stdin and answers each with one line of JSON on stdout, so the benchmark keeps a few of these
processes for a whole run and splits each point's arrival schedule between them (one asyncio loop
parsing hundreds of streams would lag behind the server and skew the timings). A job::

    {"url": "http://127.0.0.1:PORT/v1", "start_at": MONOTONIC, "timeout": S, "deadline": MONOTONIC,
     "requests": [{"i": 0, "offset": 0.13, "kind": "chat" | "completion", "stream": true,
                   "logprobs": true, "body": {...}}, ...]}

Each request is sent at ``start_at + offset`` (CLOCK_MONOTONIC, the same in every process on Linux)
through ``client.chat.completions.create`` or ``client.completions.create``. Per request the answer
holds: when it was due, sent, got its first token and ended; the tokens each streamed chunk carried
(counted from the chunk's logprobs when asked for, else one per chunk with text) and when; usage; and
the error if any: its message, when it came (``failed``) and, for an HTTP error, the status, the
error body's ``code`` and the ``Retry-After`` header. Requests still running at ``deadline`` are
cancelled (the server aborts them) and reported with ``error: "deadline"``; ``timeout`` (seconds,
default 600) is each request's HTTP timeout. The answer also says how late the process's own event
loop ran (``loop_lag``: p99 and max seconds a 10 ms sleep overslept): a client too busy to read its
streams inflates every time it measures.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


def _tokens_in(choice: Any, logprobs: bool, chat: bool) -> int:
    if logprobs and choice.logprobs is not None:
        if chat:
            return len(choice.logprobs.content or [])
        return len(choice.logprobs.tokens or [])
    text = choice.delta.content if chat else choice.text
    return 1 if text else 0


async def _one(client: Any, req: dict[str, Any], due: float) -> dict[str, Any]:
    import openai

    delay = due - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    chat, stream, logprobs = req["kind"] == "chat", req.get("stream", True), req.get("logprobs", False)
    body = dict(req["body"])
    if logprobs:
        body.update({"logprobs": True, "top_logprobs": 0} if chat else {"logprobs": 0})
    extra = body.pop("extra_body", None)
    out: dict[str, Any] = {"i": req["i"], "due": due, "sent": time.monotonic(), "first": None, "end": None}
    out.update(tokens=0, prompt_tokens=0, cached_tokens=0, chunks=[], error=None, finish=None)
    create = client.chat.completions.create if chat else client.completions.create
    try:
        if stream:
            body["stream_options"] = {"include_usage": True}
            response = await create(**body, stream=True, extra_body=extra)
            counted = 0
            async for chunk in response:
                now = time.monotonic()
                if chunk.usage is not None:
                    out["tokens"] = chunk.usage.completion_tokens
                    out["prompt_tokens"] = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    out["cached_tokens"] = (details.cached_tokens or 0) if details is not None else 0
                k = 0
                for choice in chunk.choices:
                    k += _tokens_in(choice, logprobs, chat)
                    if choice.finish_reason is not None:
                        out["finish"] = choice.finish_reason
                if k:
                    if out["first"] is None:
                        out["first"] = now
                    out["chunks"].append((round(now - out["sent"], 6), k))
                    counted += k
            out["counted"] = counted
        else:
            response = await create(**body, stream=False, extra_body=extra)
            out["tokens"] = response.usage.completion_tokens
            out["prompt_tokens"] = response.usage.prompt_tokens
            details = response.usage.prompt_tokens_details
            out["cached_tokens"] = (details.cached_tokens or 0) if details is not None else 0
            out["finish"] = response.choices[0].finish_reason if response.choices else None
            out["choices"] = len(response.choices)
        out["end"] = time.monotonic()
    except asyncio.CancelledError:
        out["error"] = "deadline"
    except openai.APIStatusError as exc:
        out["failed"] = time.monotonic()
        out["error"] = f"HTTP {exc.status_code}: {str(exc)[:300]}"
        out["status"] = exc.status_code
        out["code"] = getattr(exc, "code", None)
        out["retry_after"] = exc.response.headers.get("retry-after")
    except Exception as exc:  # connection reset, malformed stream, ...
        out["failed"] = time.monotonic()
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


LAG_PERIOD_S = 0.01  # the loop-lag probe's sleep


async def _probe_lag(lags: list[float]) -> None:
    """How late this process's event loop wakes from a short sleep: a loop busy parsing streams is
    late to every other request's chunks and answers, and its timings grow with it."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(LAG_PERIOD_S)
        lags.append(loop.time() - t - LAG_PERIOD_S)


async def run_job(job: dict[str, Any]) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=job["url"], api_key="EMPTY", max_retries=0, timeout=float(job.get("timeout", 600))
    )
    start_at = job["start_at"]
    lag_at_start = time.monotonic() - start_at  # > 0: this process got the job late
    lags: list[float] = []
    probe = asyncio.create_task(_probe_lag(lags))
    tasks = [asyncio.create_task(_one(client, r, start_at + r["offset"])) for r in job["requests"]]
    deadline = job.get("deadline")
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() for t in tasks if not t.cancelled()]
    cancelled = [r["i"] for r, t in zip(job["requests"], tasks, strict=True) if t.cancelled()]
    results += [{"i": i, "error": "deadline", "due": None, "sent": None, "end": None} for i in cancelled]
    probe.cancel()
    await client.close()
    lags.sort()
    loop_lag = {"p99": lags[int(0.99 * (len(lags) - 1))], "max": lags[-1]} if lags else None
    return {"results": results, "lag_at_start": lag_at_start, "loop_lag": loop_lag}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            answer = asyncio.run(run_job(job))
        except Exception as exc:  # report, keep serving jobs
            answer = {"results": [], "fatal": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
