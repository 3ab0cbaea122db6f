"""Anthropic's ``cache_control`` breakpoints: where a message's cached prefixes end, and for how long.

A breakpoint (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) may sit on a tool, a system block, a
message's content block, or the request itself (the last block then). The prefix it closes is the
prompt rendered up to and including that block: the same body cut after the block, through the
same chat conversion and template (``prefix_texts``); the server counts the tokens that text shares
with the whole prompt (``engine/cache_pins.py`` holds the blocks up to them). A tool's breakpoint
closes the tools, which the chat template writes beside the system prompt, so it is taken at the
system's end. At most 4, as Anthropic allows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from prefixserve.engine.cache_pins import MAX_BREAKPOINTS, TTLS
from prefixserve.protocols.errors import APIError

PLACEHOLDER = [{"role": "user", "content": "."}]  # a cut after the system needs a message to render


def _ttl(marker: Any, param: str) -> tuple[float, bool]:
    """The seconds one ``cache_control`` asks for, and whether it marks its prefix public
    (``"shared": true``, this server's extension); a 400 naming ``param`` for what Anthropic refuses."""
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
        raise APIError(
            400, "cache_control.type must be 'ephemeral'", param=f"{param}.type", code="invalid_value"
        )
    ttl = marker.get("ttl", "5m")
    if ttl not in TTLS:
        message = f"cache_control.ttl must be one of {', '.join(TTLS)}, got {ttl!r}"
        raise APIError(400, message, param=f"{param}.ttl", code="invalid_value")
    shared = marker.get("shared", False)
    if not isinstance(shared, bool):
        raise APIError(
            400, "cache_control.shared must be a boolean", param=f"{param}.shared", code="invalid_value"
        )
    return TTLS[ttl], shared


Cut = tuple[dict[str, Any], tuple[float, bool]]  # the body cut after a block; (seconds, shared)


def cuts(data: dict[str, Any]) -> list[Cut]:
    """Each breakpoint as (the body cut after its block, (seconds, shared)), in prompt order."""
    out: list[Cut] = []
    system = data.get("system")
    blocks = system if isinstance(system, list) else []
    for i, tool in enumerate(data.get("tools") or ()):
        if isinstance(tool, dict) and tool.get("cache_control") is not None:
            how = _ttl(tool["cache_control"], f"tools.{i}.cache_control")
            out.append(({**data, "messages": PLACEHOLDER}, how))
    for j, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("cache_control") is not None:
            how = _ttl(block["cache_control"], f"system.{j}.cache_control")
            out.append(({**data, "system": blocks[: j + 1], "messages": PLACEHOLDER}, how))
    messages = data.get("messages") or []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for k, block in enumerate(content if isinstance(content, list) else ()):
            if isinstance(block, dict) and block.get("cache_control") is not None:
                how = _ttl(block["cache_control"], f"messages.{i}.content.{k}.cache_control")
                cut = {**message, "content": copy.copy(content[: k + 1])}
                out.append(({**data, "messages": [*messages[:i], cut]}, how))
    if data.get("cache_control") is not None:  # the request's own: after its last block
        out.append((data, _ttl(data["cache_control"], "cache_control")))
    if len(out) > MAX_BREAKPOINTS:
        message = (
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(out)}."
        )
        raise APIError(400, message, param="cache_control", code="invalid_value")
    return out


def prefix_texts(
    data: dict[str, Any], render: Callable[[dict[str, Any]], str]
) -> list[tuple[str, float, bool]]:
    """Each breakpoint's prefix as text (``render``: a cut body to its prompt, as the whole body is
    rendered), with its seconds and whether it is public."""
    return [(render(cut), ttl, shared) for cut, (ttl, shared) in cuts(data)]


__all__ = ["cuts", "prefix_texts"]
