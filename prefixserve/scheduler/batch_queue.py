"""Queue an offline batch's requests as prefix-sharing groups (BatchLLM), planned over all of them.

The plan is made on the requests' final token ids (after an application's pinned prompt), so what
the scheduler holds for a group is exactly what its members' prompts start with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixserve.scheduler.offline import BatchPlan, plan_batch
from prefixserve.sequence import Request, TokenArray

DEFAULT_DECODE = 16  # decode length assumed for ordering when a request sets no max_tokens


def _position_key(positions: TokenArray) -> bytes | None:
    """None for positions 0, 1, 2, ... (the prompt's own), else their bytes; no Python loop."""
    pos = np.asarray(positions, dtype=np.int64)
    return None if np.array_equal(pos, np.arange(len(pos))) else pos.tobytes()


def queue_groups(engine: Any, requests: Sequence[Request], grouping: str = "first_level") -> BatchPlan:
    """Plan prefix-sharing groups over requests added with ``queue=False`` and queue them in order.

    Requests with their own position ids only share with prompts at the very same positions: their
    positions join the key that keeps cache salts apart. Prompt Cache requests already hold their
    modules' blocks (shared with every request using them), so each runs as a group of its own."""
    for r in requests:
        if r.modules is not None:
            engine.add_group([r], 0)
    requests = [r for r in requests if r.modules is None]
    keys = [(r.cache_salt, _position_key(r.prompt_positions)) for r in requests]
    plan = plan_batch(
        [r.prompt_token_ids for r in requests],
        salts=keys,
        decode_lengths=[r.params.max_tokens or DEFAULT_DECODE for r in requests],
        grouping=grouping,
    )
    for group in plan.groups:
        engine.add_group([requests[i] for i in group.members], len(group.prefix))
    return plan
