"""Prompt caching with TTLs (issue 106): Anthropic's ``cache_control`` breakpoints hold the blocks up
to them for 5 minutes or an hour, refreshed when asked again, inside a pinned-block budget; usage
reports what a request wrote (``cache_creation_input_tokens``) and read (``cache_read_input_tokens``)
as Anthropic's official client reads them.

The engine's pins are driven by a fake clock; pressure on the pool comes from other prompts, which
evict whatever nobody holds. Over HTTP, the official ``anthropic`` client against the tiny model.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import engine_checks
import pytest

from prefixserve import SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.engine.cache_pins import check_pins
from prefixserve.protocols.anthropic.cache_control import cuts
from prefixserve.protocols.errors import APIError

BS = 16
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def test_breakpoints_are_cut_where_their_blocks_end() -> None:
    marker = {"type": "ephemeral"}
    data = {
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": marker}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "c", "cache_control": {**marker, "ttl": "1h"}}],
            },
            {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e"},
        ],
        "tools": [{"name": "t", "input_schema": {}, "cache_control": marker}],
        "cache_control": marker,
    }
    got = cuts(data)
    assert [ttl for _, (ttl, _) in got] == [300.0, 300.0, 3600.0, 300.0]
    assert not any(shared for _, (_, shared) in got)
    tools, system, message, whole = (cut for cut, _ in got)
    assert tools["system"] == data["system"] and system["system"] == data["system"]  # after the system
    assert message["messages"] == [data["messages"][0]]
    assert whole is data
    bad = [({**marker, "ttl": "10m"}, "ttl"), ({"type": "persistent"}, "type")]
    for mark, field in bad:
        with pytest.raises(APIError, match=field) as exc:
            cuts(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": mark}]}
                    ]
                }
            )
        assert exc.value.param == f"messages.0.content.0.cache_control.{field}"
    with pytest.raises(APIError, match=r"cache_control\.shared must be a boolean"):
        cuts(
            {
                "messages": [],
                "system": [{"type": "text", "text": "s", "cache_control": {**marker, "shared": 1}}],
            }
        )
    five = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": marker}] * 5}
        ]
    }
    with pytest.raises(APIError, match="A maximum of 4 blocks with cache_control"):
        cuts(five)
    for pins in ([(-1, 5.0)], [(3, 0)], [(3, 5.0)] * 5, "x"):
        with pytest.raises(ValueError, match="cache"):
            check_pins(pins)


def _engine(tiny_config_path: Path, fraction: float = 0.25) -> tuple[Engine, list[float]]:
    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, max_model_len=256,
        cache_control_fraction=fraction,
    )  # fmt: skip
    engine = Engine(config, progress=False)
    now = [0.0]
    engine.cache_pins.clock = lambda: now[0]
    return engine, now


def _run(engine: Engine, rid: str, ids: list[int], pins: list[tuple[int, float]] | None = None) -> Any:
    engine.add_request(rid, None, PARAMS, prompt_token_ids=ids, cache_pins=pins)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    return final


def _flood(engine: Engine, tag: int) -> None:
    """Prompts enough to take every block nobody holds (the pool's LRU evicts the rest)."""
    for i in range(8):
        _run(engine, f"flood-{tag}-{i}", [2000 + 300 * tag + 37 * i + k for k in range(150)])


def test_a_breakpoint_holds_its_prefix_for_its_ttl_and_a_hit_refreshes_it(tiny_config_path: Path) -> None:
    engine, now = _engine(tiny_config_path)
    prefix = [500 + k for k in range(4 * BS + 6)]  # 4 whole blocks, then 6 tokens
    first = _run(engine, "a", [*prefix, 1, 2, 3], [(len(prefix), 300.0)])
    assert (first.num_cached_tokens, first.cache_written_tokens) == (0, 4 * BS)
    assert engine.cache_pins.pinned_blocks == 4
    unpinned = [900 + k for k in range(4 * BS + 6)]
    _run(engine, "u", [*unpinned, 1])
    _flood(engine, 0)
    assert _run(engine, "u2", [*unpinned, 2]).num_cached_tokens == 0  # evicted: nobody held it
    now[0] = 200.0
    hit = _run(engine, "b", [*prefix, 4, 5], [(len(prefix), 300.0)])  # read, and refreshed to 500 s
    assert (hit.num_cached_tokens, hit.cache_written_tokens) == (4 * BS, 0)
    now[0] = 350.0  # past the first TTL, inside the refreshed one
    _flood(engine, 1)
    assert _run(engine, "c", [*prefix, 6]).num_cached_tokens == 4 * BS
    now[0] = 501.0
    _flood(engine, 2)  # each arrival lets go of what has expired
    assert engine.cache_pins.pinned_blocks == 0
    assert _run(engine, "d", [*prefix, 7]).num_cached_tokens == 0
    assert engine_checks.blocks_in_use(engine) == 0


def test_breakpoints_past_the_budget_are_answered_and_not_honoured(tiny_config_path: Path) -> None:
    """A budget of 6 blocks: a 4-block breakpoint is held; a second, distinct one would need 4 more
    and is refused at intake (the request is answered; ``cache_pins_refused``); its own prefix is
    then cached as any other. The same breakpoint again is a refresh, not new blocks."""
    engine, now = _engine(tiny_config_path, fraction=6 / 64)
    assert engine.cache_pins.budget == 6
    one = [600 + k for k in range(4 * BS + 1)]
    two = [700 + k for k in range(4 * BS + 1)]
    a = _run(engine, "a", one, [(4 * BS, 3600.0)])
    b = _run(engine, "b", two, [(4 * BS, 3600.0)])
    again = _run(engine, "c", one, [(4 * BS, 3600.0)])
    assert (a.cache_pins_refused, a.cache_written_tokens) == (False, 4 * BS)
    assert (b.cache_pins_refused, b.cache_written_tokens) == (True, 0)
    assert len(b.outputs[0].token_ids) == 2
    assert (again.cache_pins_refused, again.num_cached_tokens) == (False, 4 * BS)
    now[0] = 4000.0
    engine.cache_pins.expire()
    assert engine_checks.blocks_in_use(engine) == 0


def _message(claude: Any, system: str, ask: str, **extra: Any) -> Any:
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", **extra}}]
    return claude.messages.with_raw_response.create(
        model="default", system=blocks, max_tokens=2, messages=[{"role": "user", "content": ask}],
        extra_body={"temperature": 0},
    )  # fmt: skip


def test_usage_reports_what_was_written_and_read_as_anthropics_client_reads_it(tiny_server: Any) -> None:
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=tiny_server.url, api_key="none", max_retries=0, timeout=120)
    system = f"Ticket {uuid.uuid4().hex}: you are the help desk of a ferry line. " * 8
    first = _message(claude, system, "When does the first boat leave?", ttl="1h")
    second = _message(claude, system, "Can I bring a bicycle?", ttl="1h")
    counted = claude.messages.count_tokens(
        model="default", system=system, messages=[{"role": "user", "content": "Can I bring a bicycle?"}]
    ).input_tokens
    u1, u2 = first.parse().usage, second.parse().usage
    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens >= 64
    assert u1.cache_creation_input_tokens % BS == 0  # whole blocks up to the breakpoint
    assert (
        u2.cache_creation_input_tokens == 0 and u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    )
    assert u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens == counted
    assert "prefixserve-cache-control" not in first.headers
    held = tiny_server.engine_loop.call(lambda e: e.cache_pins.pinned_blocks).result(10)
    assert held * BS == u1.cache_creation_input_tokens
    tiny_server.engine_loop.call(lambda e: e.cache_pins.clear()).result(10)  # the pins are all it holds
    engine_checks.wait_server_pool_empty(tiny_server)


def test_a_refused_breakpoint_is_answered_with_a_header_saying_so(tiny_config_path: Path) -> None:
    anthropic = pytest.importorskip("anthropic")
    from prefixserve.entrypoints.openai.server import ServerThread, build_app

    config = EngineConfig(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, cache_control_fraction=0.0
    )
    with ServerThread(build_app(config)) as srv:
        claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        raw = _message(claude, "You are a terse assistant for a library. " * 6, "Is it open today?")
        assert raw.headers["prefixserve-cache-control"].startswith("not-honoured")
        usage = raw.parse().usage
        assert usage.cache_creation_input_tokens == 0


def test_a_breakpoint_marked_shared_makes_its_prefix_public_across_salts(tiny_server: Any) -> None:
    """Two tenants' salted messages (``cache_salt`` passes through as on a chat) with one system
    prompt: its breakpoint marked ``"shared": true`` lets the second tenant read the first's system
    blocks (under the server's default scope, which shares nothing else); unmarked, nothing is read."""
    import httpx

    system = f"Desk {uuid.uuid4().hex}: you answer questions about the city's trams, politely. " * 6
    rows = []
    with httpx.Client(base_url=tiny_server.url, timeout=120) as http:
        for shared in (False, True):
            mark = {"type": "ephemeral", "shared": shared}
            for tenant in ("t1", "t2"):
                body = {
                    "model": "default", "max_tokens": 2, "cache_salt": f"{tenant}-{shared}",
                    "system": [{"type": "text", "text": system + str(shared), "cache_control": mark}],
                    "messages": [{"role": "user", "content": "Does line 4 run at night?"}],
                }  # fmt: skip
                r = http.post("/v1/messages", json=body)
                assert r.status_code == 200, r.text
                rows.append(r.json()["usage"])
    assert rows[1]["cache_read_input_tokens"] == 0  # unmarked: the salt covers the system prompt too
    assert rows[3]["cache_read_input_tokens"] >= 64  # marked: the first tenant's system blocks
    assert rows[3]["cache_read_input_tokens"] < rows[3]["cache_read_input_tokens"] + rows[3]["input_tokens"]
    tiny_server.engine_loop.call(lambda e: e.cache_pins.clear()).result(10)
    engine_checks.wait_server_pool_empty(tiny_server)
