"""Request rules behind one interface (``sampling/rules.py``, ``engine/output_rules.py``).

The engine core names no feature: only the registry (``engine/request_rules.py``) imports the rules'
modules. The ``RuleSet`` calls each hook once for all rules that have it, joins the rules' bans and
masks into the one ban and one mask the sampler takes, and its bans equal the chain the engine
called before the rules had an interface.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from prefixserve.engine.output_rules import OutputRule, OutputRules
from prefixserve.engine.request_rules import output_rules, request_rules
from prefixserve.sampling.bad_words import BadWordsRule, bad_words_ban
from prefixserve.sampling.min_tokens import MinTokensRule, min_tokens_ban
from prefixserve.sampling.params import SamplingParams, flags_of
from prefixserve.sampling.rules import Masks, RequestRule, RuleSet
from prefixserve.sampling.thinking_budget import (
    ThinkingBudget,
    ThinkingBudgetRule,
    ThinkingTags,
    thinking_force,
)
from prefixserve.sampling.token_ban import TokenBan, joined
from prefixserve.sequence import Request, token_array

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "prefixserve" / "engine"
REGISTRY = "prefixserve.engine.request_rules"  # the one engine module that assembles the rules
# the modules that hold rules: request rules, and the output rules that live in engine/
RULE_MODULES = (
    "prefixserve.sampling.min_tokens",
    "prefixserve.sampling.bad_words",
    "prefixserve.sampling.thinking_budget",
    "prefixserve.sampling.penalties",
    "prefixserve.structured",
    "prefixserve.engine.pooling",
    "prefixserve.engine.prompt_logprobs",
)


def _imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports anywhere (module level, in functions, under TYPE_CHECKING), as
    dotted names; ``from a import b`` gives both ``a`` and ``a.b`` (``b`` may be a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _is_rule_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in RULE_MODULES)


def _engine_modules() -> dict[str, Path]:
    return {f"prefixserve.engine.{p.stem}": p for p in sorted(ENGINE.glob("*.py"))}


def test_the_engine_core_imports_no_rule_module() -> None:
    """Every engine module but the registry (and the output rules' own modules) reaches the features
    through the rule sets it is handed, never by importing them."""
    found = []
    for module, path in _engine_modules().items():
        if module == REGISTRY or _is_rule_module(module):
            continue
        rule_imports = sorted(n for n in _imports(path, "prefixserve.engine") if _is_rule_module(n))
        found += [f"{module} imports {name}" for name in rule_imports]
    assert found == [], "engine core modules import rule modules (register rules in request_rules.py)"


def test_the_runner_imports_no_rule_module() -> None:
    """The model runner applies the rules' mask, ban and adjusts it is handed (penalties included)."""
    worker = ENGINE.parent / "worker"
    found = [
        f"{p.stem} imports {n}"
        for p in sorted(worker.glob("*.py"))
        for n in sorted(_imports(p, "prefixserve.worker"))
        if _is_rule_module(n)
    ]
    assert found == []


class _Adjusting(RequestRule):
    def __init__(self, name: str, add: float | None) -> None:
        self.name, self.add, self.seen = name, add, []

    def adjust(self, rows, params):
        return None if self.add is None else _Add(self)


class _Add:
    def __init__(self, rule: _Adjusting) -> None:
        self.rule = rule

    def apply(self, logits: torch.Tensor) -> None:
        logits.mul_(2).add_(self.rule.add)  # order shows: (x * 2 + a) * 2 + b

    def sampled(self, tokens: torch.Tensor) -> None:
        self.rule.seen.append(tokens.tolist())


def test_adjusts_apply_in_the_rules_order_and_see_the_sampled_tokens() -> None:
    a, b, none = _Adjusting("a", 1.0), _Adjusting("b", 3.0), _Adjusting("n", None)
    rules = RuleSet([a, none, b])
    samplers, _, params = _rows(2)
    adjust = rules.adjust(samplers, params)
    logits = torch.zeros(2, 4)
    adjust.apply(logits)
    assert logits.unique().tolist() == [5.0]  # (0 * 2 + 1) * 2 + 3
    adjust.sampled(torch.tensor([1, 2]))
    assert a.seen == b.seen == [[1, 2]] and none.seen == []
    assert RuleSet([none]).adjust(samplers, params) is None and RuleSet([]).adjust(samplers, params) is None
    assert RuleSet([a]).adjust(samplers, params).__class__ is _Add  # one rule's adjust as it is


def test_the_registry_imports_every_rule_module() -> None:
    """The list above is the real one: the registry assembles a rule from each of these modules."""
    imported = _imports(_engine_modules()[REGISTRY], "prefixserve.engine")
    assert all(any(n == m or n.startswith(m + ".") for n in imported) for m in RULE_MODULES)
    assert "llm_engine" in {m.rsplit(".", 1)[1] for m in _engine_modules()}  # the core was looked at


def test_the_import_reader_sees_every_form(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "import prefixserve.sampling.bad_words\n"
        "from prefixserve.sampling import min_tokens\n"
        "from .pooling import Pooler\n"
        "def f():\n    from prefixserve.structured.rule import X\n"
    )
    names = _imports(f, "prefixserve.engine")
    assert {"prefixserve.sampling.bad_words", "prefixserve.sampling.min_tokens"} <= names
    assert {"prefixserve.engine.pooling", "prefixserve.structured.rule"} <= names
    assert all(_is_rule_module(n) for n in names if n != "prefixserve.sampling")


# ---- the RuleSet ----------------------------------------------------------------------------------


class Banning(RequestRule):
    """A rule that bans fixed (row, id) pairs, forces others, and counts the calls of its hooks."""

    def __init__(self, name: str, ban: TokenBan | None, waits: bool = False) -> None:
        self.name, self._ban, self._waits, self.calls = name, ban, waits, []

    def ban(self, samplers: Any, indices: Any, params: Any) -> TokenBan | None:
        self.calls.append(("ban", len(params)))
        return self._ban

    def waits(self, samplers: Any, indices: Any, params: Any) -> bool:
        self.calls.append(("waits", len(params)))
        return self._waits


class Masking(RequestRule):
    """A rule whose mask keeps only ``allowed`` tokens in ``row``."""

    def __init__(self, name: str, row: int, allowed: list[int] | None) -> None:
        self.name, self.row, self.allowed = name, row, allowed

    def mask(self, samplers: Any, indices: Any, params: Any) -> Any:
        if self.allowed is None:
            return None
        rule = self

        class RowMask:
            def apply(self, logits: torch.Tensor) -> None:
                keep = logits[rule.row, rule.allowed].clone()
                logits[rule.row] = float("-inf")
                logits[rule.row, rule.allowed] = keep

        return RowMask()


def _rows(n: int) -> tuple[list[Any], list[int], list[SamplingParams]]:
    return [SimpleNamespace(index=0) for _ in range(n)], list(range(n)), [SamplingParams()] * n


def test_bans_are_joined_in_order_and_none_is_nothing() -> None:
    a = Banning("a", TokenBan([0, 1], [5, 6]))
    b = Banning("b", None)
    c = Banning("c", TokenBan([2], [7], forced_rows=[1], forced_ids=[3]))
    mask, ban = RuleSet([a, b, c]).restrict(*_rows(3))
    assert mask is None
    assert ban == TokenBan([0, 1, 2], [5, 6, 7], [1], [3])
    assert RuleSet([b]).restrict(*_rows(3)) == (None, None)
    assert RuleSet([]).restrict(*_rows(3)) == (None, None)


def test_a_ban_of_one_rule_beats_a_token_another_forces() -> None:
    forcing = Banning("force", TokenBan([], [], forced_rows=[0, 1], forced_ids=[2, 4]))
    banning = Banning("ban", TokenBan([1], [4]))
    for order in ([forcing, banning], [banning, forcing]):
        _, ban = RuleSet(order).restrict(*_rows(2))
        logits = torch.zeros(2, 6)
        ban.apply(logits)
        assert logits[0].argmax() == 2
        assert logits[1, 4] == float("-inf") and torch.isfinite(logits[1, :4]).all()


def test_masks_are_combined_a_token_stays_where_every_mask_allows_it() -> None:
    one = Masking("one", 0, [1, 2, 3])
    other = Masking("other", 0, [2, 3, 4])
    third = Masking("third", 1, [0])
    mask, ban = RuleSet([one, other, Masking("none", 0, None), third]).restrict(*_rows(2))
    assert ban is None and isinstance(mask, Masks) and len(mask.parts) == 3  # flattened, Nones dropped
    logits = torch.zeros(2, 5)
    mask.apply(logits)
    assert torch.isfinite(logits[0]).tolist() == [False, False, True, True, False]
    assert torch.isfinite(logits[1]).tolist() == [True, False, False, False, False]
    single, _ = RuleSet([one]).restrict(*_rows(2))
    assert not isinstance(single, Masks)  # one rule's mask goes to the sampler as it is


def test_masks_and_bans_together() -> None:
    mask, ban = RuleSet([Masking("m", 0, [1, 2]), Banning("b", TokenBan([0], [2]))]).restrict(*_rows(1))
    logits = torch.zeros(1, 4)
    mask.apply(logits)  # the runner: the mask on the raw logits, the ban on the ones the choice reads
    ban.apply(logits)
    assert torch.isfinite(logits[0]).tolist() == [False, True, False, False]


def test_hooks_go_only_to_rules_that_have_them_and_waits_stops_at_the_first() -> None:
    first, second = Banning("first", None, waits=True), Banning("second", None)
    masking = Masking("m", 0, None)
    rules = RuleSet([masking, first, second])
    samplers, indices, params = _rows(2)
    assert rules.waits(samplers, indices, params) is True
    assert first.calls == [("waits", 2)] and second.calls == []
    assert rules._waits == (first, second) and rules._masks == (masking,) and rules._advances == ()


def test_rules_see_the_samplers_rows_only() -> None:
    """Speculated rows follow the samplers' in ``params``: bans and masks see the samplers', with the
    step's flags kept (they gate the rules' work)."""
    rule = Banning("b", None)
    samplers, indices, _ = _rows(2)
    params = [SamplingParams(min_tokens=2)] * 2 + [SamplingParams(bad_words=["x"])] * 3
    seen = []
    rule.ban = lambda s, i, p: seen.append(p)  # type: ignore[method-assign]
    RuleSet([rule]).restrict(samplers, indices, params)
    assert len(seen[0]) == 2 and flags_of(seen[0]) == flags_of(params)


def test_admit_keeps_each_rules_state_and_check_raises_the_first_refusal() -> None:
    class Stating(RequestRule):
        def __init__(self, name: str, state: Any, refusal: str | None = None) -> None:
            self.name, self.state, self.refusal = name, state, refusal

        def check(self, params: SamplingParams, tokenizer: Any) -> None:
            if self.refusal:
                raise ValueError(self.refusal)

        def admit(self, request: Any, tokenizer: Any) -> Any:
            return self.state

    req = Request("r", None, token_array([1, 2]), token_array([0, 1]), SamplingParams())
    assert req.rules == {}
    RuleSet([Stating("a", [1]), Stating("b", None), Stating("c", 0)]).admit(req, None)
    assert req.rules == {"a": [1], "c": 0}  # None: the rule does not apply; 0 is a state
    with pytest.raises(ValueError, match="first"):
        RuleSet([Stating("a", None, "first"), Stating("b", None, "second")]).check(SamplingParams(), None)
    with pytest.raises(ValueError, match="a name of its own"):
        RuleSet([Stating("a", None), Stating("a", None)])
    with pytest.raises(ValueError, match="a name of its own"):
        RuleSet([RequestRule()])


# ---- the engine's rules, through the set, equal the chain the engine called before --------------

TAGS = ThinkingTags(start=(7, 8), end=(9, 10, 11))


class Chars:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def _sequence(prompt: list[int], output: list[int], params: SamplingParams, rules: dict[str, Any]) -> Any:
    req = SimpleNamespace(params=params, rules=rules, prompt_token_ids=prompt, num_prompt_tokens=len(prompt))
    ids = token_array([*prompt, *output, -1])  # -1: the placeholder of the token sampled now
    return SimpleNamespace(index=0, request=req, token_ids=ids, num_prompt_tokens=len(prompt))


def test_the_engines_rules_equal_the_old_chain() -> None:
    eos = {2}
    chars = Chars()
    rules = request_rules(eos, 300, "cpu", 8, "qwen3")
    assert [r.name for r in rules.rules] == [
        "structured_outputs",
        "min_tokens",
        "bad_words",
        "thinking_budget",
        "logit_bias",
        "allowed_token_ids",
        "penalties",
    ]
    assert rules.find("structured_outputs").decoding is None  # xgrammar is not imported until asked
    min_p = SamplingParams(min_tokens=5, stop_token_ids=[9])
    words_p = SamplingParams(bad_words=["ab", "c"])
    budget_p = SamplingParams(thinking_token_budget=2)
    seqs = [
        _sequence([1, 1], [4], min_p, {}),
        _sequence([1], [ord("x"), ord("a")], words_p, {}),
        _sequence([1], [5, 5], budget_p, {}),
        _sequence([1], [5], SamplingParams(), {}),
    ]
    for seq in seqs:
        rules.check(seq.request.params, chars)
        rules.admit(seq.request, chars)
    budget = seqs[2].request.rules["thinking_budget"]
    seqs[2].request.rules["thinking_budget"] = ThinkingBudget(2, TAGS, True)  # opened by the prompt
    assert isinstance(budget, ThinkingBudget) and "bad_words" in seqs[1].request.rules
    samplers = seqs
    indices = [len(s.token_ids) - 1 for s in seqs]
    params = [s.request.params for s in seqs]
    mask, ban = rules.restrict(samplers, indices, params)
    old = min_tokens_ban(samplers, indices, params, eos)
    old = joined(old, bad_words_ban(samplers, indices, params))
    old = joined(old, thinking_force(samplers, indices, params))
    assert mask is None and ban == old
    assert ban is not None and ban.forced_rows == [2] and ban.forced_ids == [9]
    pairs = list(zip(ban.rows, ban.ids, strict=True))
    assert (1, ord("b")) in pairs and (1, ord("c")) in pairs
    assert rules.waits(samplers, indices, params)  # a two-token word: its ban reads the token before


def test_the_rules_refuse_as_intake_did() -> None:
    rules = RuleSet([MinTokensRule({2}), BadWordsRule(), ThinkingBudgetRule(None)])
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        rules.check(SamplingParams(bad_words=["x"]), None)
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        rules.check(SamplingParams(thinking_token_budget=3), Chars())
    with pytest.raises(ValueError, match="needs the constraint after the thought"):
        spec = {"choice": ["a"]}
        RuleSet([ThinkingBudgetRule("qwen3")]).check(
            SamplingParams(thinking_token_budget=3, structured_outputs=spec), Chars()
        )
    rules.check(SamplingParams(), None)  # asking for none of them: nothing needed


# ---- output rules ---------------------------------------------------------------------------------


def test_output_rules_report_their_fields_only_for_requests_holding_their_state() -> None:
    class Field(OutputRule):
        def __init__(self, name: str, key: str) -> None:
            self.name, self.key = name, key

        def admit(self, req: Request, pooling: Any) -> None:
            if req.params.max_tokens == 3:
                req.rules[self.name] = self.key

        def report(self, req: Request, finished: bool) -> dict[str, Any] | None:
            return {self.key: finished} if self.name in req.rules else None

    rules = OutputRules([Field("a", "embedding"), Field("b", "prompt_token_logprobs")])
    asks = Request("r", None, token_array([1]), token_array([0]), SamplingParams(max_tokens=3))
    plain = Request("q", None, token_array([1]), token_array([0]), SamplingParams(max_tokens=4))
    for req in (asks, plain):
        rules.admit(req, None)
    assert rules.report(asks, True) == {"embedding": True, "prompt_token_logprobs": True}
    assert rules.report(plain, True) == {}
    assert [r.name for r in output_rules(torch.device("cpu"), 16).rules] == ["prompt_logprobs", "pooling"]
