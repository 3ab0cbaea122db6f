"""StructuredOutputs: what a request's output must match (vLLM's ``StructuredOutputsParams`` names).

Pure data, checked on creation: which one constraint (a JSON schema, any JSON object, a regex, a
choice of strings, an EBNF grammar) and its spec. Compiling it needs xgrammar and the model's
tokenizer (``prefixserve.structured``); nothing here imports either, so the engine core runs without
xgrammar installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True)
class StructuredOutputs:
    """Exactly one of the constraints; bad values raise ValueError naming the field.

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``; ``choice``:
    the output is one of these strings; ``grammar``: EBNF (GBNF style, a ``root`` rule).
    ``structural_tag``: xgrammar's structural tag (its JSON, or a dict): free text with tagged
    parts that must match their schemas (vLLM's; both its ``format`` form and the older
    ``structures`` + ``triggers`` one). ``disable_any_whitespace``: JSON without free whitespace
    (compact separators).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    # a thinking model's reasoning goes first, free (``<think> ... </think>``): "opened" where the
    # prompt opened the <think> (the output starts inside it), "optional" where the output may open
    # one; the constraint holds from after ``</think>`` (and any whitespace). None: from the start
    after_thinking: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(KINDS)
            raise ValueError(f"structured_outputs takes exactly one of {names}; got {given or 'none'}")
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag, ensure_ascii=False)
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {exc}") from None
        checks = [
            (self.json is None or isinstance(self.json, dict), "structured_outputs.json must be an object"),
            (self.regex is None or (isinstance(self.regex, str) and self.regex), "structured_outputs.regex "
             "must be a non-empty string"),
            (self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
             "structured_outputs.grammar must be a non-empty string"),
            (self.structural_tag is None or _json_object(self.structural_tag),
             "structured_outputs.structural_tag must be a JSON object (or its text)"),
            (self.choice is None or (isinstance(self.choice, list) and self.choice
                                     and all(isinstance(c, str) and c for c in self.choice)),
             "structured_outputs.choice must be a non-empty list of non-empty strings"),
        ]  # fmt: skip
        if self.after_thinking not in (None, "opened", "optional"):
            checks.append((False, "structured_outputs.after_thinking must be 'opened' or 'optional'"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool, str | None]:
        """What the compiled grammar depends on: the kind, the spec as canonical text, the whitespace,
        the thinking before it."""
        kind = self.kind
        spec = getattr(self, kind)
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, ensure_ascii=False)
        return kind, text, self.disable_any_whitespace, self.after_thinking


def _json_object(text: Any) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except ValueError:
        return False


StructuredOutputsParams = StructuredOutputs  # vLLM's name


def as_structured(value: Any) -> StructuredOutputs | None:
    """``SamplingParams.structured_outputs`` as given: None, a StructuredOutputs, or a dict of its fields."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {*KINDS, "disable_any_whitespace"}
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {sorted(unknown)}")
        return StructuredOutputs(**value)
    raise ValueError("structured_outputs must be a StructuredOutputs or a dict")


__all__ = ["KINDS", "StructuredOutputs", "StructuredOutputsParams", "as_structured"]
