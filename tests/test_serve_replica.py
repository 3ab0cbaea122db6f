"""``call_asgi``: a replica drives its app without a socket; queued body chunks go as one item."""

from __future__ import annotations

import asyncio
from typing import Any

from prefixserve.ray_scaleout.serve_replica import call_asgi


def _app(chunks: list[bytes], pause: float) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})
            if pause:
                await asyncio.sleep(pause)

    return app


async def _collect(app: Any, slow_reader: bool) -> list[Any]:
    items = []
    async for item in call_asgi(app, "POST", "/v1/completions", "", [("a", "b")], b"{}"):
        items.append(item)
        if slow_reader:
            await asyncio.sleep(0.05)  # the app writes everything meanwhile
    return items


def test_chunks_queued_behind_a_slow_reader_are_joined() -> None:
    chunks = [f"data: {i}\n\n".encode() for i in range(6)]
    items = asyncio.run(_collect(_app(chunks, 0.0), slow_reader=True))
    assert items[0] == {"status": 200, "headers": [("x-a", "1")]}
    assert b"".join(items[1:]) == b"".join(chunks)  # every byte, in order
    assert len(items) - 1 < len(chunks)  # and fewer items than chunks


def test_a_reader_keeping_up_gets_each_chunk_as_it_comes() -> None:
    chunks = [f"data: {i}\n\n".encode() for i in range(4)]
    items = asyncio.run(_collect(_app(chunks, 0.02), slow_reader=False))
    assert items[1:] == chunks
