"""Which form an e4m3 decode walk of the paged kernel takes, chosen per launch on the host: cut into
``attend.E4M3_WALKS`` walks (``attend.attend_range_walks``) or one walk capped in registers
(``attend.attend_range_fetched``), and the KV splits that suit the cut form (docs/kernels.md §2.13).
A decode graph keeps the form in its key (``graph_attention.walks_for``): its block tables are the
bucket's, far wider than most steps' walks."""

from __future__ import annotations

from prefixserve.attention.kernels import attend

# A program cuts its e4m3 decode walk into ``attend.E4M3_WALKS`` walks (a warp each) only where it walks
# at least this many tokens, and its grid is one split a sequence or fits one wave of them (2 programs
# an SM: 211 registers). On an H200 (8B heads) the cut walks took 0.92-0.97x the one walk's time from
# B=64 at 4K-16K, but 1.13-1.22x at 1K; at B=16, 16K: 4 splits 289 us cut, 228 one walk (4 programs
# an SM, ``E4M3_FETCH_REGISTERS``), 2 splits cut 216 (docs/kernels.md §2.13).
E4M3_WALK_MIN_RUN = 4096
E4M3_WALK_PROGRAMS_PER_SM = 2


def e4m3_walks(num_splits: int, run: int, programs: int, sms: int) -> int:
    """The runs a launch's e4m3 decode walk is cut into: ``attend.E4M3_WALKS`` where a program walks
    at least ``E4M3_WALK_MIN_RUN`` tokens (``run``: the split's length, or the table's over the splits
    where they are sized in the kernel) and its grid of ``programs`` is one split a sequence or one wave
    of cut walks, else 1. Only fetched e4m3 walks without ids ahead read it."""
    one_wave = programs <= E4M3_WALK_PROGRAMS_PER_SM * sms
    cut = run >= E4M3_WALK_MIN_RUN and (num_splits == 1 or one_wave)
    return attend.E4M3_WALKS.value if cut else 1


def e4m3_wave_splits(max_kv: int, base_programs: int, sms: int) -> int:
    """KV splits that make a decode step's e4m3 walks one wave of cut walks (``e4m3_walks``), or 0 where
    that leaves a split shorter than ``E4M3_WALK_MIN_RUN`` (or none: a grid past one wave unsplit)."""
    splits = E4M3_WALK_PROGRAMS_PER_SM * sms // max(1, base_programs)
    return splits if splits >= 1 and max_kv / splits >= E4M3_WALK_MIN_RUN else 0


# ptxas's cap on a thread's registers where an e4m3 walk holds its next tile in registers
# (``attend.attend_range_fetched``, one walk): 157 uncapped, 3 programs an SM on an H200, and B=64's
# 512 programs took 1.3 waves; capped, 4 an SM (B=64 at 4K: 281 -> 226 us; docs/kernels.md §2.13). A
# split's walk with its block ids ahead measured the same either way and is left uncapped, as are
# the cut walks (211 registers, 2 an SM).
E4M3_FETCH_REGISTERS = 128


def register_cap(max_registers: int | None, one_walk: bool) -> dict[str, int]:
    """The launch's ``maxnreg`` option: the caller's, else ``E4M3_FETCH_REGISTERS`` for a compiled
    e4m3 decode walk a tile's ids at a time in one walk (``one_walk``; not ids ahead, prefill tiles or
    cut walks), else none."""
    if max_registers is None and one_walk and attend.FETCH_E4M3_AHEAD and not attend.INTERPRETED:
        max_registers = E4M3_FETCH_REGISTERS
    return {"maxnreg": max_registers} if max_registers else {}
