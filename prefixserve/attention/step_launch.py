"""How a step's attention launches go out, shared by the eager backend (``triton_backend.py``) and the
decode graphs (``graph_attention.py``): the two-kernel path (shared kernel, on a side stream when
given, beside the own kernel, then the merge), the mixed path (one mixed launch, then the merge), and
the replay of recorded launches with a later layer's tensors.

A path launches through Triton's normal path once and returns ``Recorded`` launches; every later
layer (eager) or a graph capture repeats them with ``replay_launches`` (``triton_support/launch.py``: the
compiled kernel's launcher called directly, the layer's q / K / V / output swapped in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.triton_support.launch import relaunch

if TYPE_CHECKING:  # annotations only: mixed_rule imports the Gluon kernels
    from prefixserve.attention.planning.mixed_rule import MixedTiles

# argument positions that change from layer to layer: (q, k_cache, v_cache, output), -1 = none
PAGED_OUT = (0, 1, 2, 6)  # paged kernel writing the final output (one split)
PAGED_PART = (0, 1, 2, -1)  # paged kernel writing fp32 partials (step buffers)
SHARED = (0, 1, 2, -1)  # the shared kernel, and the mixed kernel
MERGE = (-1, -1, -1, 4)
# a decode step's paged kernel merging its own splits (``paged_attention.MERGED_OUT``: its out_ptr)
PAGED_MERGED = (0, 1, 2, 25)

Recorded = tuple[Any, tuple[int, int, int, int], bool]  # (launch, per-layer argument positions, on side)


def relaunch_layer(
    launch: Any, pos: tuple[int, int, int, int], tensors: tuple[torch.Tensor, ...], stream: Any = None
) -> None:
    """Relaunch a recorded launch with this layer's tensors at ``pos`` (-1: that one stays), on
    ``stream`` (None: the current one)."""
    relaunch(launch, [(i, t) for i, t in zip(pos, tensors, strict=True) if i >= 0], stream)


_FORK_EVENTS: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}  # side stream handle -> (fork, join)


def _fork_events(side: Any) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Two events kept for a side stream's fork and join: ``wait_stream`` makes a new event a call, and
    with ``torch.cuda.stream``'s switch and back that was most of a layer's host time on the eager
    shared path (docs/kernels.md §2.16). An event is recorded again only after its wait is issued."""
    events = _FORK_EVENTS.get(side.cuda_stream)
    if events is None:
        events = _FORK_EVENTS[side.cuda_stream] = (torch.cuda.Event(), torch.cuda.Event())
    return events


def csr_merge(o_part, lse_part, rows: int, row_ptr, part_idx, out, out_lse=None) -> Callable[[list], Any]:
    """The step's CSR merge of its partials into ``out`` (and each row's LSE into ``out_lse``, for
    attention sinks), as the ``launch_*_path`` functions take it: called with a list, it launches and
    records its launch there."""
    from prefixserve.attention.kernels import merge

    return lambda rec: merge.merge_partials(
        o_part, lse_part, rows, row_ptr=row_ptr, part_idx=part_idx, out=out, out_lse=out_lse,
        want_lse=out_lse is not None, launches=rec,
    )  # fmt: skip


def launch_split_path(
    shared: Callable[[], Any], own: Callable[[], Any], merge: Callable[[list], Any], side: Any
) -> list[Recorded]:
    """Shared kernel (on ``side`` when given, concurrent with the own kernel), own kernel, join, merge.

    Launches through Triton's normal path and returns the records that ``replay_launches`` repeats
    for the step's later layers (eager) or that a graph capture replays (``graph_attention.py``).
    """
    launches: list[Recorded] = []
    main = torch.cuda.current_stream() if side is not None else None
    if side is not None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            sl = shared()
    else:
        sl = shared()
    if sl is not None:
        launches.append((sl, SHARED, side is not None))
    ol = own()
    if ol is not None:
        launches.append((ol, PAGED_PART, False))
    if side is not None:
        main.wait_stream(side)
    rec: list[Any] = []
    merge(rec)
    return launches + [(m, MERGE, False) for m in rec]


def launch_mixed_path(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    step_lists: tuple[torch.Tensor, ...],  # (segment rows, work items, own tables, own lengths)
    parts: tuple[torch.Tensor, torch.Tensor, int],  # (o_part, lse_part, first own slot)
    merge: Callable[[list], Any],
    mixed: MixedTiles,
    count: torch.Tensor | None = None,
) -> list[Recorded]:
    """The mixed launch (a decode step's shared and own tiles, one own partial per row; own tiles of
    ``mixed.own_m`` rows, shared tiles of ``mixed.shared_n`` tokens), then the merge; the eager path
    and the decode graphs both launch it here. ``count``: the work items in use, on the device (a
    graph's list is a capacity)."""
    from prefixserve.attention.kernels import mixed_gluon
    from prefixserve.attention.planning import tiles

    o_part, lse_part, own_slot0 = parts
    launch = mixed_gluon.launch_mixed(
        q,
        k_cache,
        v_cache,
        *step_lists,
        o_part,
        lse_part,
        scale,
        own_slot0=own_slot0,
        programs=tiles.num_sms(q.device),
        own_m=mixed.own_m,
        shared_n=mixed.shared_n,
        count=count,
    )
    rec: list[Any] = []
    merge(rec)
    return [(launch, SHARED, False)] + [(m, MERGE, False) for m in rec]


def replay_launches(launches: list[Recorded], tensors: tuple[torch.Tensor, ...], side: Any) -> None:
    """Relaunch recorded launches with this layer's (q, k_cache, v_cache, out), side stream included.

    The main stream joins the side stream before the merge only if this call forked it: a graph
    capture must see both ends of every fork (a paged-only path never forks).
    """
    main, forked = None, False
    for launch, pos, on_side in launches:
        if on_side and side is not None:
            main = torch.cuda.current_stream(tensors[0].device)
            fork, join = _fork_events(side)
            fork.record(main)
            side.wait_event(fork)
            relaunch_layer(launch, pos, tensors, side)
            forked = True
            continue
        if forked and pos is MERGE:
            join.record(side)
            main.wait_event(join)
            forked = False
        relaunch_layer(launch, pos, tensors)


__all__ = [
    "MERGE",
    "PAGED_MERGED",
    "PAGED_OUT",
    "PAGED_PART",
    "SHARED",
    "Recorded",
    "csr_merge",
    "launch_mixed_path",
    "launch_split_path",
    "relaunch_layer",
    "replay_launches",
]
