"""Another API's streamed events from the chat stream states (Responses, Messages).

The chat stream states decide what text is settled and when a tool call is whole; ``AsEvents``,
mixed in before one, hands each chat choice it would send to ``events`` (``ResponseEvents`` or
``MessageEvents``), which writes that API's events instead, and lets it open and close the stream.
"""

from __future__ import annotations

from typing import Any

from prefixserve.outputs import RequestOutput


class AsEvents:
    """Sends a chat stream state's choices as ``events``' (mixed in before the state)."""

    events: Any  # before(out), choice(choice), opening(), closing(finals), failed(error)

    def before(self, out: RequestOutput) -> list[str]:
        return self.events.before(out)

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        return self.before(out) + super().update(prompt_index, out)  # type: ignore[misc]

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        return "".join(self.events.choice(c) for c in choices)

    def _plain_chunk(self, index: int, delta: str, finish: str | None) -> str:
        return self.events.choice({"delta": {"content": delta} if delta else {}, "finish_reason": finish})

    def opening(self) -> list[str]:
        return self.events.opening()

    def closing(self, finals: list[RequestOutput]) -> list[str]:
        return self.events.closing(finals)

    def error_event(self, error: dict[str, Any]) -> str:
        return self.events.failed(error)


__all__ = ["AsEvents"]
