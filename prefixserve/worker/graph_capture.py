"""One CUDA graph capture into a shared memory pool, undone cleanly when it fails.

When a capture fails (an operation the capture cannot hold, a collective whose peer is gone), ending
it raises inside ``torch.cuda.graph``'s exit before PyTorch's caching allocator stops routing this
thread's allocations to the pool, and before the capture's side stream is left. The engine goes on
(the step runs eagerly), but the allocator keeps a capture it thinks is under way: on 2 x H200 with
torch 2.11 a process whose piecewise capture had failed this way aborted at exit (the pool's
destructor asserts that no capture is under way). ``capture_into`` ends both itself when the capture fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def capture_into(graph: torch.cuda.CUDAGraph, pool: tuple[int, int]) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)``; on failure the pool's routing and the capture stream
    are ended too, then the error goes on to the caller."""
    context = torch.cuda.graph(graph, pool=pool)
    try:
        with context:
            yield
    except BaseException:
        end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_pool is not None:
            with contextlib.suppress(RuntimeError):  # already ended: nothing was left behind
                end_pool(torch.cuda.current_device(), pool)
        stream = getattr(context, "stream_ctx", None)
        if stream is not None:  # back to the stream before the capture (a repeat exit is harmless)
            with contextlib.suppress(Exception):
                stream.__exit__(None, None, None)
        raise


__all__ = ["capture_into"]
