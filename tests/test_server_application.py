"""Pinned system prompts over HTTP: the ``application`` field on both endpoints."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app

SYSTEM = "You are a terse assistant for a bicycle shop. " * 12  # ~120 tokens: several KV blocks


@pytest.fixture(scope="module")
def http(tiny_config_path: Path) -> Iterator[httpx.Client]:
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, system_prompts={"shop": SYSTEM}
    )
    built: list[Any] = []
    loader = threading.Thread(target=lambda: built.append(build_app(config)), daemon=True)
    loader.start()
    loader.join(30)  # pinning runs the system prompt through the engine at start-up: bound it
    if not built:
        pytest.fail("the engine did not finish pinning the system prompt within 30 s")
    with ServerThread(built[0]) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def test_application_prompt_is_used_and_cached(http: httpx.Client) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "application": "shop"}
    for _ in range(2):
        out = http.post("/v1/chat/completions", json=chat)
        assert out.status_code == 200, out.text
        usage = out.json()["usage"]
        assert usage["prompt_tokens"] > 100  # the pinned system prompt is part of the prompt
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 96
    done = http.post("/v1/completions", json={"prompt": "Q: gears?", "max_tokens": 2, "application": "shop"})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


def test_unknown_application_is_refused(http: httpx.Client) -> None:
    for route, body in (
        ("/v1/completions", {"prompt": "x", "application": "nope"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "application": "nope"}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}], "application": "nope"}),
    ):
        out = http.post(route, json=body)
        assert out.status_code == 400
        error = out.json()["error"]
        assert "unknown application 'nope'" in error["message"] and error["param"] == "application"


def test_a_chat_with_its_own_system_message_keeps_it_alone(http: httpx.Client) -> None:
    """The pinned prompt goes in front of a chat that has no system message, never beside one."""
    messages = [{"role": "system", "content": "Talk like a pirate."}, {"role": "user", "content": "hi"}]
    chat = {"messages": messages, "max_tokens": 3, "temperature": 0}
    alone = http.post("/v1/chat/completions", json=chat).json()
    named = http.post("/v1/chat/completions", json={**chat, "application": "shop"}).json()
    assert named["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] < 100
    assert named["choices"][0]["message"] == alone["choices"][0]["message"]


def test_a_completion_past_the_context_counts_the_pinned_prompt(http: httpx.Client) -> None:
    """The server's check before its queue counts the pinned prompt the engine puts in front."""
    pinned = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "application": "shop"})
    head = pinned.json()["usage"]["prompt_tokens"] - 1
    body = {"prompt": [5] * (2048 - head), "max_tokens": 1, "application": "shop"}
    out = http.post("/v1/completions", json=body)
    assert out.status_code == 400 and out.json()["error"]["code"] == "context_length_exceeded"
    assert f"the prompt has {2048} tokens" in out.json()["error"]["message"]
    fits = http.post("/v1/completions", json={**body, "prompt": [5] * (2047 - head)})
    assert fits.status_code == 200, fits.text
