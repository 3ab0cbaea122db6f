"""A request's output constraint, from the fields clients send, checked with the field named in errors.

OpenAI clients send ``response_format`` (``json_object``, or ``json_schema`` with a schema: what
``client.chat.completions.parse`` sends for a pydantic model); vLLM clients send ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one may be given. A spec is parsed
here (``structured.grammars.check``, no tokenizer needed), so a bad schema, regex or grammar is a 400
naming the field before anything is queued.
"""

from __future__ import annotations

from typing import Any

from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.request_models import ChatCompletionRequest, CompletionRequest
from prefixserve.sampling.structured_outputs import KINDS, StructuredOutputs

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def checked(spec: StructuredOutputs, field: str) -> StructuredOutputs:
    """``spec`` once it parses; else a 400 naming ``field`` (the request's own name for it)."""
    try:
        from prefixserve.structured.grammars import check

        check(spec)
    except ValueError as exc:
        message = str(exc).replace(f"structured_outputs.{spec.kind}", field, 1)
        raise APIError(400, message, param=field, code="invalid_value") from None
    return spec


def _make(field: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", param=field, code="invalid_value") from None


def _from_response_format(rf: dict[str, Any]) -> tuple[StructuredOutputs | None, str]:
    kind = rf.get("type", "text")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return _make("response_format", json_object=True), "response_format"
    if kind == "structural_tag":  # vLLM's: the tag is the response format itself
        return _make("response_format", structural_tag=rf), "response_format"
    if kind != "json_schema":
        message = (
            "response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
            f"got {kind!r}"
        )
        raise APIError(400, message, param="response_format.type", code="invalid_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        message = "response_format.json_schema must be an object with a 'schema'"
        raise APIError(400, message, param="response_format.json_schema", code="invalid_value")
    schema = js.get("schema", {"type": "object"})  # OpenAI: no schema means any object
    field = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise APIError(400, f"{field} must be a JSON object", param=field, code="invalid_value")
    return _make(field, json=schema), field


def _from_structured_outputs(so: dict[str, Any]) -> tuple[StructuredOutputs, str]:
    known = {*KINDS, "disable_any_whitespace", "whitespace_pattern", "structural_tag", "backend"}
    unsupported = sorted(k for k in so if k not in known or k == "whitespace_pattern")
    if unsupported:
        message = f"structured_outputs: unsupported fields {unsupported}"
        raise APIError(400, message, param="structured_outputs", code="invalid_value")
    fields = {k: v for k, v in so.items() if k in (*KINDS, "disable_any_whitespace") and v is not None}
    given = [k for k in KINDS if fields.get(k) not in (None, False)]
    field = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return _make("structured_outputs", **fields), field


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The request's constraint, checked; None if it has none. A 400 names the offending field."""
    found: list[tuple[StructuredOutputs | None, str]] = []
    if req.response_format is not None:
        found.append(_from_response_format(req.response_format))
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((_make(name, **{kind: value}), name))
    found = [(spec, field) for spec, field in found if spec is not None]
    if len(found) > 1:
        names = ", ".join(field.split(".")[0] for _, field in found)
        message = f"give one output constraint, not several ({names})"
        raise APIError(400, message, param=found[1][1].split(".")[0], code="invalid_value")
    if not found:
        return None
    spec, field = found[0]
    return checked(spec, field)


__all__ = ["checked", "structured_outputs"]
