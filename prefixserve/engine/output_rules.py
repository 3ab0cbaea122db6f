"""Output rules: what a request asks the engine to report beyond its samples (prompt logprobs, an
embedding), behind one interface, as request rules are for its sampling (``sampling/rules.py``).

An output rule reads the prompt rows a step computes, before the sampling takes the hidden states,
keeps per-block results that a prefix-cache hit then reuses, and fills its fields of the request's
output. Its hooks, each called by the engine through ``OutputRules`` (the defaults do nothing):

* ``prepare(params, pooling, prompt)``: before intake, the sampling params the request runs under
  (an embedding request's: one greedy token), or a ValueError refusing it.
* ``admit(request, pooling)``: once the request is made: its state, at ``Request.rules[rule.name]``,
  where the rule applies (and the request among its ``active`` ones).
* ``collect(scheduled, first_row, launch, runner, blocks)``: a step's rows, called only while the rule
  has ``active`` requests; ``discard(request)``: the request is retired.
* ``wants``, ``known_blocks``, ``seed``: the block manager's ``row_keepers`` hooks (how far a hit may
  go for a request that needs every prompt row's result, and the kept results it starts from).
* ``report(request, finished)``: the ``RequestOutput`` fields it fills (None: none); asked only of a
  request that holds some rule's state (a rule reports only where it admitted the request).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from prefixserve.pooling_params import PoolingParams
from prefixserve.sampling.params import SamplingParams
from prefixserve.sequence import Request, Sequence

if TYPE_CHECKING:
    from prefixserve.scheduler.block_tables import BlockManager
    from prefixserve.scheduler.scheduler import ScheduledSeq
    from prefixserve.worker.model_runner import Launch, ModelRunner


class OutputRule:
    """One output feature's hooks (see the module's docstring). ``name`` keys its per-request state."""

    name: str = ""
    active: Collection[Request] = ()  # requests whose prompt rows it still reads

    def prepare(
        self, params: SamplingParams | None, pooling: PoolingParams | None, prompt: str | None
    ) -> SamplingParams | None:
        return params

    def admit(self, req: Request, pooling: PoolingParams | None) -> None:
        """Its state for ``req`` where the request asks (nothing otherwise)."""

    def collect(
        self,
        scheduled: list[ScheduledSeq],
        first_row: int,
        launch: Launch,
        runner: ModelRunner,
        blocks: BlockManager,
    ) -> None:
        """Read the prompt rows this launch computes (rows from ``first_row``), before the sequences'
        computed counts advance and the sampling takes the hidden states."""

    def discard(self, req: Request) -> None:
        """``req`` is retired: no more rows of it are read."""

    def wants(self, req: Request) -> bool:
        return False

    def known_blocks(self, seq: Sequence, digests: list[bytes]) -> int:
        return len(digests)

    def seed(self, seq: Sequence, num_blocks: int) -> int:
        return 0

    def report(self, req: Request, finished: bool) -> dict[str, Any] | None:
        """The ``RequestOutput`` fields it fills for ``req`` now (None: none)."""
        return None


class OutputRules:
    """The engine's output rules, in order, built at engine setup (``engine/request_rules.py``)."""

    def __init__(self, rules: Iterable[OutputRule]) -> None:
        self.rules = tuple(rules)
        names = [rule.name for rule in self.rules]
        if not all(names) or len(set(names)) != len(names):
            raise ValueError(f"each output rule needs a name of its own; got {names}")

    def prepare(
        self, params: SamplingParams | None, pooling: PoolingParams | None, prompt: str | None
    ) -> SamplingParams | None:
        for rule in self.rules:
            params = rule.prepare(params, pooling, prompt)
        return params

    def admit(self, req: Request, pooling: PoolingParams | None) -> None:
        for rule in self.rules:
            rule.admit(req, pooling)

    def collect(
        self,
        scheduled: list[ScheduledSeq],
        first_row: int,
        launch: Launch,
        runner: ModelRunner,
        blocks: BlockManager,
    ) -> None:
        for rule in self.rules:
            if rule.active:
                rule.collect(scheduled, first_row, launch, runner, blocks)

    def discard(self, req: Request) -> None:
        for rule in self.rules:
            rule.discard(req)

    def report(self, req: Request, finished: bool) -> dict[str, Any]:
        """Every rule's fields of ``req``'s output (empty for a request none applies to)."""
        fields: dict[str, Any] = {}
        if req.rules:  # most requests: no rule's state, nothing to ask
            for rule in self.rules:
                got = rule.report(req, finished)
                if got:
                    fields.update(got)
        return fields


__all__ = ["OutputRule", "OutputRules"]
