"""Bounded character repeats folded into what follows them: the same language, masks from the cache.

xgrammar unrolls ``c{lo, hi}`` (a string's ``maxLength``, a JSON ``max_whitespace_cnt`` run) into a
chain ``r1 ::= "" | c r2``, ``r2 ::= "" | c r3``, ... whose rules end *inside* the chain. A token
that runs past a rule's end cannot be judged from that rule's precomputed mask, so in the chain's
deep states most of the vocabulary is left "uncertain" and checked one token at a time at every
step: 2-20 ms per row inside a 16-character string on a CPU, against ~10 us for a state the cache
decides (``benchmarks/probes/structured_fill.py``). Folding the rest of the sequence into the
chain, ``A c{lo, hi} B`` -> ``A c..c t0``, ``t_k ::= B | c t_{k+1}``, ``t_m ::= B``, makes every
rule end where the sequence ends: a token too long for the string now fails inside the rule
(decided at compile time) and only tokens crossing the closing quote stay uncertain.

This works on xgrammar's printed grammar (one rule a line: a choice of sequences of strings,
classes and rule references). A rule it does not read as such is left as it is, and so is a grammar
whose printing holds an escaped byte above 0x7f: xgrammar prints single UTF-8 bytes so (a JSON schema
excluding a non-ASCII property name from its additional ones builds them) and reads them back as
code points, another language.
"""

from __future__ import annotations

import re

LIMIT = 256  # widest repeat folded (hi - lo): each step of the chain is a rule compiled into the cache

_RULE = re.compile(r"^([A-Za-z_]\w*) ::= (.*)$")
_HIGH_BYTE = re.compile(r"\\x[89a-fA-F][0-9a-fA-F]")  # \x80-\xff: printed bytes, read back as code points
_CLASS_RULE = re.compile(r"^\(\((\[(?:\\.|[^\]\\])*\])\)\)$")  # name ::= (([...]))
_REPEAT = re.compile(r"^([A-Za-z_]\w*)\{(\d+), (-?\d+)\}$")
_TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"'  # a string
    r"|\[(?:\\.|[^\]\\])*\][*+?]?"  # a character class
    r"|[A-Za-z_]\w*(?:\{\d+, -?\d+\})?"  # a rule reference, maybe repeated
    r"|\(=|[()|]"  # a lookahead's start, grouping, choice
    r"|\s+"
)


def reads_back(ebnf: str) -> bool:
    """Does xgrammar read this printed grammar back as the same language (no printed high bytes)?"""
    return _HIGH_BYTE.search(ebnf) is None


def _tokens(body: str) -> list[str] | None:
    out, i = [], 0
    while i < len(body):
        m = _TOKEN.match(body, i)
        if m is None:
            return None
        if not m.group().isspace():
            out.append(m.group())
        i = m.end()
    return out


def _choices(body: str) -> tuple[list[list[str]], str] | None:
    """``((a b) | (c) | "")`` -> ([[a, b], [c], []], lookahead text), or None if it is not that."""
    toks = _tokens(body)
    if not toks or toks[0] != "(":
        return None
    alts: list[list[str]] = []
    i = 1
    while True:
        if toks[i] == '""':
            alts.append([])
            i += 1
        elif toks[i] == "(":
            j = i + 1
            while j < len(toks) and toks[j] not in "()|" and toks[j] != "(=":
                j += 1
            if j >= len(toks) or toks[j] != ")" or j == i + 1:
                return None
            alts.append(toks[i + 1 : j])
            i = j + 1
        else:
            return None
        if i >= len(toks):
            return None
        if toks[i] == ")":
            break
        if toks[i] != "|":
            return None
        i += 1
    rest = _after_group(body)
    if rest and not rest.startswith("(="):
        return None
    return alts, rest


def _after_group(body: str) -> str:
    """What follows the body's outer group (a lookahead assertion, or nothing)."""
    depth, i = 0, 0
    while i < len(body):
        ch = body[i]
        if ch in '"[':
            m = _TOKEN.match(body, i)
            i = m.end() if m else i + 1
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return body[i + 1 :].strip()
        i += 1
    return ""


def fold_repeats(ebnf: str, limit: int = LIMIT) -> str | None:
    """``ebnf`` (xgrammar's printed grammar) with each bounded repeat of a character class that has
    something after it folded into it; None if there is none (or the text does not read back as
    the same grammar)."""
    if not reads_back(ebnf):
        return None
    lines = ebnf.strip().splitlines()
    rules: dict[str, str] = {}
    for line in lines:
        m = _RULE.match(line)
        if m is None:
            return None
        rules[m.group(1)] = m.group(2)
    classes = {name: c.group(1) for name, body in rules.items() if (c := _CLASS_RULE.match(body))}
    names = set(rules)
    out: dict[str, str] = {}
    todo = list(rules.items())
    folded = 0

    def fresh(base: str) -> str:
        n = 0
        while f"{base}_fold{n}" in names:
            n += 1
        names.add(f"{base}_fold{n}")
        return f"{base}_fold{n}"

    def seq(elems: list[str]) -> str:
        return "(" + " ".join(elems) + ")" if elems else '""'

    while todo:
        name, body = todo.pop(0)
        parsed = _choices(body)
        if parsed is None:
            out[name] = body
            continue
        alts, lookahead = parsed
        changed = False
        for a, elems in enumerate(alts):
            for i, e in enumerate(elems):
                r = _REPEAT.match(e)
                if r is None or r.group(1) not in classes or i == len(elems) - 1:
                    continue
                lo, hi = int(r.group(2)), int(r.group(3))
                if hi < 0 or hi == lo or hi - lo > limit:
                    continue
                c, rest = classes[r.group(1)], elems[i + 1 :]
                if len(rest) > 1:  # the rest once, as a rule of its own (folded in turn)
                    tail = fresh(name)
                    todo.append((tail, f"({seq(rest)})"))
                    rest = [tail]
                chain = [fresh(name) for _ in range(hi - lo + 1)]
                for k, link in enumerate(chain):
                    more = f" | ({c} {chain[k + 1]})" if k + 1 < len(chain) else ""
                    out[link] = f"({seq(rest)}{more})"
                alts[a] = elems[:i] + [c] * lo + [chain[0]]
                changed = True
                folded += 1
                break
        out[name] = (
            "(" + " | ".join(seq(x) for x in alts) + ")" + (f" {lookahead}" if lookahead else "")
            if changed
            else body
        )
    if not folded:
        return None
    return "\n".join(f"{name} ::= {body}" for name, body in out.items()) + "\n"


__all__ = ["LIMIT", "fold_repeats", "reads_back"]
