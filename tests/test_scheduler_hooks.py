"""The scheduler's and the block manager's hooks are given at construction (``SchedulerHooks``,
``BlockManagerHooks``), never assigned afterwards: no module of prefixserve assigns one (read
statically), the hooks cannot be assigned at run time, and each hook given is the one called.
The engine's speculator, made before the scheduler, drafts nothing until its ``max_model_len`` is set.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from prefixserve.config import SpeculativeConfig
from prefixserve.engine.speculative import Speculator
from prefixserve.kv.block_pool import BlockPool
from prefixserve.sampling.params import SamplingParams
from prefixserve.scheduler.block_tables import BlockManager, BlockManagerHooks
from prefixserve.scheduler.scheduler import Scheduler, SchedulerHooks, SchedulerOutput
from prefixserve.sequence import Request, SeqStatus, Sequence, token_array

ROOT = Path(__file__).resolve().parents[1]
SCHEDULER_HOOKS = {f.name for f in dataclasses.fields(SchedulerHooks)}
BLOCK_HOOKS = {f.name for f in dataclasses.fields(BlockManagerHooks)}
# the objects a hook could be assigned on: an attribute or a variable of these names
OWNERS = {
    "scheduler": SCHEDULER_HOOKS | {"hooks", "_hooks"},
    "sched": SCHEDULER_HOOKS | {"hooks", "_hooks"},
    "blocks": BLOCK_HOOKS | {"hooks", "_hooks"},
    "block_manager": BLOCK_HOOKS | {"hooks", "_hooks"},
}
BS = 4
_ids = itertools.count()


def _owner_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def hook_assignments(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: target`` of each assignment to a scheduler or block-manager hook (``x.scheduler.
    refuse = ...``, ``self.blocks.restore = ...``, tuple targets, ``setattr(x.scheduler, "ready", f)``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr in OWNERS.get(
                _owner_name(target.value) or "", ()
            ):
                found.append((node.lineno, f"{filename}:{node.lineno}: {ast.unparse(target)}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in OWNERS.get(_owner_name(node.args[0]) or "", ())
        ):
            owner = ast.unparse(node.args[0])
            found.append((node.lineno, f"{filename}:{node.lineno}: setattr({owner}, ...)"))
    return [text for _, text in sorted(found)]


def test_no_module_assigns_a_scheduler_or_block_manager_hook() -> None:
    found = []
    for path in sorted((ROOT / "prefixserve").rglob("*.py")):
        found += hook_assignments(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "hooks are given at construction (SchedulerHooks, BlockManagerHooks): " + "; ".join(
        found
    )


def test_the_scan_finds_each_form_of_assignment() -> None:
    code = """
self.scheduler.refuse = f
self.scheduler.reclaim, self.scheduler.ready = a, b
engine.blocks.restore = spill.restore
self.blocks.row_keepers: list = []
sched.speculate = s
setattr(engine.scheduler, "speculate", s)
self.scheduler.hooks = h
self.scheduler.waiting = []  # not a hook
self.blocks.pool = p  # not a hook
other.refuse = f  # not a scheduler
"""
    found = hook_assignments(code)
    assert [line.split(": ", 1)[1] for line in found] == [
        "self.scheduler.refuse",
        "self.scheduler.ready",
        "self.scheduler.reclaim",
        "engine.blocks.restore",
        "self.blocks.row_keepers",
        "sched.speculate",
        "setattr(engine.scheduler, ...)",
        "self.scheduler.hooks",
    ]


def _seq(request_id: str, tokens: int) -> Sequence:
    prompt, places = list(range(1, tokens + 1)), range(tokens)
    req = Request(request_id, None, token_array(prompt), token_array(places), SamplingParams(max_tokens=4))
    seq = Sequence(next(_ids), req, 0, token_array(prompt), token_array(places))
    req.sequences.append(seq)
    return seq


def test_hooks_default_to_none_are_keyword_only_and_read_only() -> None:
    blocks = BlockManager(BlockPool(8, BS))
    sched = Scheduler(blocks, 16, 4)
    assert sched.hooks == SchedulerHooks()
    assert (sched.reclaim, sched.ready, sched.refuse, sched.speculate) == (None, None, None, None)
    assert blocks.restore is None and blocks.row_keepers == ()
    with pytest.raises(TypeError):
        Scheduler(blocks, 16, 4, None, "fcfs", SchedulerHooks())  # type: ignore[misc]
    with pytest.raises(TypeError):
        BlockManager(BlockPool(8, BS), True, None, BlockManagerHooks())  # type: ignore[misc]
    for name in (*SCHEDULER_HOOKS, "hooks"):
        with pytest.raises(AttributeError):
            setattr(sched, name, None)
    for name in (*BLOCK_HOOKS, "hooks"):
        with pytest.raises(AttributeError):
            setattr(blocks, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.hooks.refuse = print  # type: ignore[misc]


def test_the_scheduler_calls_the_hooks_it_was_given() -> None:
    calls: list[tuple[str, object]] = []

    class Spec:
        def propose(self, running: list[Sequence], budget: int) -> None:
            calls.append(("propose", budget))

        def settle(self, out: SchedulerOutput) -> None:
            calls.append(("settle", len(out.scheduled)))

    def ready(seq: Sequence) -> bool:
        calls.append(("ready", seq.request.request_id))
        return True

    def reclaim(head: Sequence, own: bool) -> int:
        calls.append(("reclaim", own))
        return 0

    def refuse(seq: Sequence, why: str) -> None:
        calls.append(("refuse", seq.request.request_id))
        sched.finish(seq)

    hooks = SchedulerHooks(reclaim=reclaim, ready=ready, refuse=refuse, speculate=Spec())
    sched = Scheduler(BlockManager(BlockPool(2, BS)), 16, 4, hooks=hooks)  # 8 tokens of KV
    sched.add(_seq("fits", 6))
    out = sched.schedule()
    assert [s.seq.request.request_id for s in out.scheduled] == ["fits"]
    assert calls == [("propose", 16), ("ready", "fits"), ("settle", 1)]
    sched.finish(out.scheduled[0].seq)
    calls.clear()
    too_long = _seq("too-long", 40)  # its first chunk (16 tokens) needs 4 blocks: never fits
    sched.add(too_long)
    out = sched.schedule()
    assert out.scheduled == [] and too_long.status is SeqStatus.FINISHED
    assert calls == [
        ("propose", 16),
        ("ready", "too-long"),
        ("reclaim", False),
        ("reclaim", True),
        ("refuse", "too-long"),
        ("settle", 0),
    ]


def test_the_block_manager_calls_the_hooks_it_was_given() -> None:
    pool = BlockPool(16, BS)
    asked: list[int] = []

    def restore(digests: object) -> list[int]:
        asked.append(len(digests))  # type: ignore[arg-type]
        return []

    class Keeper:
        def wants(self, req: Request) -> bool:
            return True

        def known_blocks(self, seq: Sequence, digests: list[bytes]) -> int:
            return 1

        def seed(self, seq: Sequence, num_blocks: int) -> int:
            return 0

    blocks = BlockManager(pool, hooks=BlockManagerHooks(restore=restore, row_keepers=(Keeper(),)))
    seq = _seq("a", 13)  # 3 full blocks a hit may cover; the keeper lets it go as far as 1
    assert blocks.match_prefix(seq) == 0
    assert asked == [1]


def test_the_speculator_drafts_nothing_until_its_max_model_len_is_set() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    seq = _seq("r", 4)
    seq.append_token(1)  # the last token occurred before: a draft would follow it
    seq.status = SeqStatus.RUNNING
    seq.num_computed_tokens = len(seq.token_ids) - 1
    spec.propose([seq], 64)
    assert spec.drafted == {} and len(seq.token_ids) == 5
    spec.set_max_model_len(64)
    spec.propose([seq], 64)
    assert spec.drafted == {seq: 2} and seq.token_ids.tolist()[5:] == [2, 3]
