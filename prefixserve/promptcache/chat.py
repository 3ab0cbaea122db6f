"""Chat templates for PML: the text a model's template puts around each message, read off it once.

Prompt Cache lays a schema out piece by piece, so it cannot hand a whole conversation to
``apply_chat_template``; instead the template is rendered with marker contents and cut at the
markers, giving per role the text before and after a message's content, the same for a message that
opens the conversation (a template may add a BOS or a default system turn there), and the
generation prompt. Laid end to end around the contents, these pieces are the template's own
rendering of the conversation. Pure Python: the tokenizer is only asked to render text.

Also here: a chat conversation whose first message is a ``<prompt>`` document becomes one PML prompt,
its later messages appended as role turns (``chat_prompt``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

from prefixserve.promptcache.pml import ROLES, PMLError, is_pml_prompt

_MARK = "\x00PML-CONTENT\x00"
_ANCHORS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "."},),
    ({"role": "user", "content": "."},),
    ({"role": "user", "content": "."}, {"role": "assistant", "content": "."}),
)


@dataclass(frozen=True, slots=True)
class ChatFrames:
    """What a chat template renders around message contents."""

    before: dict[str, str]  # role -> text before the content of a message that is not the first
    after: dict[str, str]  # role -> text after a message's content
    first_before: dict[str, str]  # role -> text before the content of the conversation's first message
    generation: str  # what add_generation_prompt=True appends (the assistant header)

    def message(self, role: str, content: str, first: bool, open_end: bool = False) -> tuple[str, str, str]:
        """(text before, content, text after) of one message; ``open_end``: an unfinished final
        assistant message, continued by the model (no end-of-turn after it)."""
        if role not in self.before:
            raise PMLError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        head = self.first_before[role] if first else self.before[role]
        return head, content, "" if open_end else self.after[role]

    @classmethod
    def of(cls, tokenizer: Any) -> ChatFrames | None:
        """The frames of ``tokenizer``'s chat template; None when it has none (role tags then add no text)."""
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return None

        def render(messages: list[dict[str, str]], generation: bool = False) -> str:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            return str(text)

        before: dict[str, str] = {}
        after: dict[str, str] = {}
        first: dict[str, str] = {}
        for role in ROLES:
            first[role], _ = _split(render([{"role": role, "content": _MARK}]), role)
            before[role], after[role] = _after_anchor(render, role)
        try:
            plain = [{"role": "user", "content": "."}]
            with_header = render(plain, generation=True)
            bare = render(plain)
        except Exception as exc:
            raise PMLError(f"the chat template cannot render a user message: {exc}") from None
        if not with_header.startswith(bare):
            raise PMLError("the chat template's generation prompt does not follow the conversation")
        return cls(before, after, first, with_header[len(bare) :])


def _split(text: str, role: str) -> tuple[str, str]:
    head, sep, tail = text.partition(_MARK)
    if not sep:
        raise PMLError(f"the chat template does not render a {role} message's content as written")
    return head, tail


def _after_anchor(render: Any, role: str) -> tuple[str, str]:
    """A message's frame when other messages come before it: rendered after an anchor conversation
    and cut where the anchor's own rendering ends (templates that refuse some role orders are
    tried with the next anchor)."""
    for anchor in _ANCHORS:
        if anchor[-1]["role"] == role:
            continue
        try:
            head = render(list(anchor))
            full = render([*anchor, {"role": role, "content": _MARK}])
        except Exception:
            continue
        if full.startswith(head):
            return _split(full[len(head) :], role)
    raise PMLError(f"the chat template does not render a {role} message after other messages")


# ---- a chat whose first message is a PML prompt ----------------------------------------------------
_CLOSE = re.compile(r"</prompt\s*>\s*\Z")
_SELF_CLOSED = re.compile(r"/>\s*\Z")


def chat_prompt(messages: list[dict[str, str]]) -> str | None:
    """One PML prompt for a conversation whose first message is a ``<prompt>`` document: the document
    with each later message appended as a role turn. None when the first message is not PML.

    ``developer`` messages are system turns, as in the chat API."""
    if not messages or not is_pml_prompt(messages[0].get("content") or ""):
        return None
    for i, m in enumerate(messages[1:], start=1):
        if is_pml_prompt(m.get("content") or ""):
            problem = f"message {i} is a <prompt> document: only the conversation's first message may be one"
            raise PMLError(problem)
    turns = []
    for m in messages[1:]:
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:
            raise PMLError(f"a message with role {m['role']!r} cannot follow a <prompt> document")
        turns.append(f"<{role}>{escape(m.get('content') or '')}</{role}>")
    doc = str(messages[0]["content"])
    if not turns:
        return doc
    closing = _CLOSE.search(doc)
    if closing is not None:
        return doc[: closing.start()] + "".join(turns) + "</prompt>"
    opening_end = doc.find(">")
    if _SELF_CLOSED.search(doc) and opening_end == len(doc.rstrip()) - 1:  # <prompt schema="..."/>
        return doc.rstrip()[:-2] + ">" + "".join(turns) + "</prompt>"
    return doc + "".join(turns)  # malformed: the parser names the line and column
