"""A failed CUDA graph capture leaves no pool routing behind (``worker/graph_capture.py``), on CPU with
the pieces of ``torch.cuda`` it touches stood in for."""

from __future__ import annotations

import pytest
import torch

from prefixserve.worker import graph_capture


class _Stream:
    def __init__(self) -> None:
        self.exits = 0

    def __exit__(self, *args: object) -> None:
        self.exits += 1


class _Graph:
    """``torch.cuda.graph`` whose exit raises as PyTorch's does when ending an invalidated capture."""

    def __init__(self, graph: object, pool: tuple[int, int], fail: bool) -> None:
        self.stream_ctx, self.fail = _Stream(), fail

    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        if self.fail:
            raise RuntimeError("operation failed due to a previous error during capture")
        self.stream_ctx.__exit__()


@pytest.mark.parametrize("fail", [True, False])
def test_a_failed_capture_ends_its_pool_and_stream(monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    ended: list[tuple[int, tuple[int, int]]] = []
    made: list[_Graph] = []

    def graph(g: object, pool: tuple[int, int]) -> _Graph:
        made.append(_Graph(g, pool, fail))
        return made[-1]

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: ended.append((d, p)), raising=False)
    capture = graph_capture.capture_into
    if fail:
        with pytest.raises(RuntimeError, match="during capture"), capture(object(), (0, 7)):
            pass
        assert ended == [(3, (0, 7))] and made[0].stream_ctx.exits == 1
    else:
        with graph_capture.capture_into(object(), (0, 7)):
            pass
        assert ended == [] and made[0].stream_ctx.exits == 1
