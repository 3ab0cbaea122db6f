"""StructuredOutputs -> xgrammar grammars: checked without a tokenizer, compiled once per engine.

``check`` parses a spec into an ``xgrammar.Grammar`` (no tokenizer needed), so the server can refuse a
bad schema, regex or grammar with a 400 before anything is queued. ``GrammarCache`` holds the
engine's ``TokenizerInfo`` (built once: it walks the whole vocabulary) and compiles each distinct
spec once, keyed by ``StructuredOutputs.key()``, with its bounded character repeats folded first
(``repeats``: the same language, far cheaper masks); a compiled grammar is what each request's
matcher runs on. xgrammar is imported here only, at first use.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.structured.repeats import fold_repeats, reads_back

# JSON with free whitespace lets a small model emit newlines forever; bounded runs still allow pretty
# printing and keep every output able to end
MAX_WHITESPACE = 8
CACHE_SIZE = 256  # compiled grammars kept per engine (a JSON schema's is tens of KB to a few MB)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a thinking model's reasoning (after_thinking)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - the structured extra is not installed
        raise ValueError("structured outputs need xgrammar: pip install 'prefixserve[structured]'") from None
    return xgrammar


def _clean(exc: Exception) -> str:
    """xgrammar's C++ message without its timestamp, source location and check text."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: .*? is false:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _source(spec: StructuredOutputs) -> tuple[str, Any, dict[str, Any]]:
    """(how to build it, its text, options): ``json`` (schema), ``regex`` or ``ebnf``."""
    whitespace: dict[str, Any] = {"any_whitespace": not spec.disable_any_whitespace}
    if not spec.disable_any_whitespace:
        whitespace["max_whitespace_cnt"] = MAX_WHITESPACE
    kind = spec.kind
    if kind == "json":
        return "json", json.dumps(spec.json), {**whitespace, "strict_mode": True}
    if kind == "json_object":  # any object: properties are free, so not strict
        return "json", json.dumps({"type": "object"}), {**whitespace, "strict_mode": False}
    if kind == "regex":
        return "regex", spec.regex, {}
    if kind == "choice":
        return "ebnf", choice_ebnf(spec.choice or []), {}
    if kind == "structural_tag":
        return "structural_tag", spec.structural_tag, {}
    return "ebnf", spec.grammar, {}


_checked: OrderedDict[tuple[str, str, bool, str | None], None] = OrderedDict()  # specs that passed ``check``


def parse(spec: StructuredOutputs) -> Any:
    """The spec's ``xgrammar.Grammar`` as xgrammar parses it (no tokenizer needed; not folded)."""
    xgr = _xgrammar()
    how, source, options = _source(spec)
    if how == "json":
        grammar = _no_raw_controls(xgr.Grammar.from_json_schema(source, **options))
    elif how == "regex":
        grammar = xgr.Grammar.from_regex(source)
    elif how == "structural_tag":
        grammar = structural_tag(source)
    else:
        grammar = xgr.Grammar.from_ebnf(source)
    return grammar if spec.after_thinking is None else after_thinking(grammar, spec.after_thinking)


def structural_tag(text: str) -> Any:
    """A structural tag's grammar: xgrammar's ``format`` form, or the older ``structures`` (begin,
    schema, end) with ``triggers`` that vLLM still takes."""
    xgr = _xgrammar()
    tag = json.loads(text)
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(text)
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
        for s in tag["structures"]
    ]
    return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))


def _names_tokens(spec: StructuredOutputs, exc: Exception) -> bool:
    """A structural tag that names tokens by their text (``token``, ``exclude_token``, ...): only a
    compiler with the tokenizer can build it, as vLLM compiles it."""
    return spec.kind == "structural_tag" and "tokenizer" in str(exc).lower()


def after_thinking(grammar: Any, how: str) -> Any:
    """``grammar`` behind a thinking model's free reasoning: any text up to ``</think>`` (from the
    output's start where the prompt ``opened`` it, else from a leading ``<think>``, or none at all
    where the output does not open one), then whitespace, then ``grammar``."""
    xgr = _xgrammar()
    begin = "" if how == "opened" else THINK_OPEN
    tag = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_CLOSE}
    thinking = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))
    behind = xgr.Grammar.concat(thinking, xgr.Grammar.from_regex(r"\s*"), grammar)
    return behind if how == "opened" else xgr.Grammar.union(behind, grammar)


# xgrammar 0.2.8 builds a string with minLength / maxLength from this character, which lets the
# control characters U+0000-U+001F through raw, where JSON (RFC 8259) allows them only escaped
_LOOSE_CHAR = r"(([^\"\\\r\n]))"
_JSON_CHAR = r"(([^\0-\x1f\"\\\r\n]))"  # the character of xgrammar's unbounded strings


def _no_raw_controls(grammar: Any) -> Any:
    """A JSON schema's grammar whose bounded strings take the characters its other strings take.
    One whose printing holds ``\\x80``-``\\xff`` escapes stays as built, raw control characters and
    all: a character U+0080-U+00FF in a property name, enum or const prints so, and so do the lone
    UTF-8 bytes of rules excluding a non-ASCII name, which would read back as other characters."""
    text = str(grammar)
    if _LOOSE_CHAR not in text or not reads_back(text):
        return grammar
    return _xgrammar().Grammar.from_ebnf(text.replace(_LOOSE_CHAR, _JSON_CHAR))


def folded(grammar: Any) -> Any:
    """``grammar`` with its bounded character repeats folded (``repeats``): the same language, whose
    masks inside a ``maxLength`` string or a whitespace run come from the compiled cache."""
    text = fold_repeats(str(grammar))
    if text is None:
        return grammar
    try:
        return _xgrammar().Grammar.from_ebnf(text)
    except Exception:  # pragma: no cover - a printing the fold misread: compile the grammar as it was
        return grammar


def check(spec: StructuredOutputs) -> None:
    """Raise ValueError naming the spec's kind if it is not a valid schema, regex or grammar.

    Parses without a tokenizer (no compile), so callers without the engine can check; specs that
    passed are remembered, so a client repeating its schema pays once.
    """
    key = spec.key()
    if key in _checked:
        return
    _xgrammar()  # outside the try: a missing xgrammar says so, not that the spec is bad
    try:
        parse(spec)
    except Exception as exc:
        if _names_tokens(spec, exc):  # checked where it compiles, with the tokenizer (``GrammarCache``)
            return
        how = _source(spec)[0]
        what = {
            "json": "invalid JSON schema",
            "regex": "invalid regex",
            "ebnf": "invalid grammar",
            "structural_tag": "invalid structural tag",
        }[how]
        raise ValueError(f"structured_outputs.{spec.kind}: {what}: {_clean(exc)}") from None
    _checked[key] = None
    if len(_checked) > CACHE_SIZE:
        _checked.popitem(last=False)


class GrammarCache:
    """One engine's compiler: its tokenizer's info, built once, and each distinct spec compiled once."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None, threads: int = 2
    ) -> None:
        """``tokenizer``: a Hugging Face tokenizer, or xgrammar's ``TokenizerInfo`` of one (the matcher
        process gets the engine's that way)."""
        xgr = _xgrammar()
        info = tokenizer
        if not isinstance(tokenizer, xgr.TokenizerInfo):
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
            )
        self.info = info
        self.vocab_size = vocab_size  # the model's: its logits may be wider than the tokenizer's vocabulary
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self._compiled: OrderedDict[tuple[str, str, bool, str | None], Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of ``spec`` (``xgrammar.CompiledGrammar``); ValueError if it is bad."""
        compiled = self.cached(spec)
        if compiled is None:
            compiled = self.put(spec, self.compile(spec))
        return compiled

    def cached(self, spec: StructuredOutputs) -> Any | None:
        """``spec``'s compiled grammar if it is in the cache (counted as a hit), else None."""
        key = spec.key()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self.hits += 1
            self._compiled.move_to_end(key)
        return compiled

    def compile(self, spec: StructuredOutputs) -> Any:
        """Compile ``spec`` without touching the cache (safe on another thread); ValueError if bad."""
        check(spec)  # the clear message for a bad spec
        try:
            try:
                return self.compiler.compile_grammar(folded(parse(spec)))
            except Exception as exc:
                if not _names_tokens(spec, exc) or spec.after_thinking is not None:
                    raise
                # a tag naming tokens by their text: resolved by the compiler, which has the tokenizer
                return self.compiler.compile_structural_tag(spec.structural_tag)
        except Exception as exc:
            raise ValueError(f"structured_outputs.{spec.kind}: cannot compile: {_clean(exc)}") from None

    def put(self, spec: StructuredOutputs, compiled: Any) -> Any:
        """Cache ``compiled`` as ``spec``'s grammar (a miss); returns it."""
        self.misses += 1
        self._compiled[spec.key()] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled


__all__ = ["MAX_WHITESPACE", "GrammarCache", "check", "choice_ebnf", "folded", "parse"]
