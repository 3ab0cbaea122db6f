"""Which rows of a PML request's modules are recomputed in its context (accuracy recovery).

A Prompt Cache module is encoded alone, so a module placed after others never attended to them, and
its first tokens play "attention sink" for a prompt that starts elsewhere. Two ways buy most of that
back by recomputing a few of each module's rows in the request's context, through every layer:

* ``link:K`` (EPIC's LegoLink): the first K tokens of every piece after the first. O(K x pieces).
* ``blend:R`` (CacheBlend): a fraction R of each piece's rows, where the cached KV is furthest from
  the in-context KV at layer 1 (the first layer whose KV sees the context). Chosen a KV block at a
  time: a block is the unit of sharing, so whole blocks are recomputed, and every block not chosen
  stays the one all requests read.

The recomputed rows go into private copies of just the blocks they fall in; every other row stays
shared. ``none`` is Prompt Cache as the paper has it. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("none", "link", "blend")


@dataclass(frozen=True, slots=True)
class Recompute:
    """A recovery setting: ``kind`` with its K (link) or R (blend)."""

    kind: str = "none"
    tokens: int = 0  # link: K
    ratio: float = 0.0  # blend: R

    @property
    def spec(self) -> str:
        if self.kind == "link":
            return f"link:{self.tokens}"
        if self.kind == "blend":
            return f"blend:{self.ratio:g}"
        return "none"

    @property
    def needs_deviation(self) -> bool:
        return self.kind == "blend" and 0.0 < self.ratio < 1.0


NONE = Recompute()


def parse_recompute(spec: str | Recompute | None) -> Recompute:
    """``"none"``, ``"link:K"`` (K >= 1 tokens) or ``"blend:R"`` (0 < R <= 1); a ValueError names
    the problem."""
    if spec is None:
        return NONE
    if isinstance(spec, Recompute):
        return spec
    text = str(spec).strip().lower()
    if text == "none":
        return NONE
    kind, sep, value = text.partition(":")
    if kind == "link" and sep:
        try:
            k = int(value)
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(
                f"module_recompute {spec!r}: link takes a whole number of tokens >= 1, as in 'link:16'"
            )
        return Recompute("link", tokens=k)
    if kind == "blend" and sep:
        try:
            r = float(value)
        except ValueError:
            r = math.nan
        if not 0.0 < r <= 1.0:
            raise ValueError(
                f"module_recompute {spec!r}: blend takes a fraction in (0, 1], as in 'blend:0.15'"
            )
        return Recompute("blend", ratio=r)
    raise ValueError(f"module_recompute {spec!r} is not one of 'none', 'link:K', 'blend:R'")


def link_runs(piece_rows: Sequence[int], tokens: int) -> list[tuple[int, int]]:
    """Rows to recompute for ``link:tokens``, as (piece index, first row, end row) per piece after
    the first, rows counted within the piece."""
    return [(i, 0, min(tokens, rows)) for i, rows in enumerate(piece_rows) if i > 0 and rows > 0]


def blend_blocks(
    piece_rows: Sequence[int], scores: Sequence[Sequence[float]], ratio: float, block_size: int
) -> list[list[int]]:
    """For ``blend:ratio``: the blocks (indices within each piece) to recompute, per piece.

    ``scores[i][j]`` is piece i's block j's deviation (any non-negative measure; larger = further from
    its in-context KV). Piece 0 is never recomputed (nothing comes before it). A piece recomputes
    ``ceil(ratio x rows / block_size)`` blocks, its highest scores first (ties: earlier blocks).
    """
    out: list[list[int]] = []
    for i, rows in enumerate(piece_rows):
        n_blocks = -(-rows // block_size)
        if i == 0 or rows == 0:
            out.append([])
            continue
        count = min(n_blocks, math.ceil(ratio * rows / block_size - 1e-9))
        if ratio >= 1.0:
            count = n_blocks
        piece_scores = list(scores[i]) if i < len(scores) else []
        piece_scores += [0.0] * (n_blocks - len(piece_scores))
        order = sorted(range(n_blocks), key=lambda j: (-piece_scores[j], j))
        out.append(sorted(order[:count]))
    return out


def block_runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive block indices as (first, end) runs: each becomes one recompute query of rows."""
    runs: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs
