"""Attention sinks (gpt-oss) on every backend against an fp64 oracle that writes the sink as an extra
logit column: full and sliding layers, decode rows sharing a prefix (shared segments, the window
plans) and prefill rows, the Triton paths' LSE (the final merge's, or the kernel's with one split)."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE, rel_err
from test_window_attention import _case, _oracle

from prefixserve.attention.backend import backend_for_model, make_backend
from prefixserve.attention.window import attend_layer

CASES = {
    "decode_shared_prefix": ([1, 1, 1, 1], [70, 75, 69, 80], 4),
    "prefill_and_decode": ([1, 6, 1, 9], [70, 75, 69, 80], 4),
}


@pytest.mark.parametrize("name", ["reference", "cascade", "auto", "triton", "triton_paged"])
@pytest.mark.parametrize("case", list(CASES))
def test_sinks_on_every_backend_match_the_oracle(name: str, case: str) -> None:
    query_lens, seq_lens, shared = CASES[case]
    q, k, v, tables, meta = _case(11, query_lens, seq_lens, shared, 2, 32, 16, torch.float32)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    backend = make_backend(name)
    backend.prepare(meta)
    for window in (None, 10, 200):  # full; a window inside the shared prefix; one covering everything
        ref = _oracle(q, k, v, tables, query_lens, seq_lens, 0.2, window, sinks)
        for _ in range(2):  # the second layer replays the first one's recorded launches
            got = attend_layer(backend, q, k, v, meta, 0.2, window, sinks)
            assert rel_err(got, ref) < 1e-5, (name, window)


def test_a_model_with_sinks_takes_backends_that_return_the_lse(monkeypatch) -> None:
    """Every selectable backend returns the LSE today; one that did not would be refused by name."""
    from prefixserve.attention.no_attention import NoAttentionBackend

    for name in ("auto", "cascade", "reference", "triton", "triton_paged", "none"):
        assert backend_for_model(name, sinks=True).name == name
    monkeypatch.setattr(NoAttentionBackend, "takes_sinks", False)
    assert backend_for_model("none", sinks=False).name == "none"
    with pytest.raises(ValueError, match="attention='none' does not take attention sinks"):
        backend_for_model("none", sinks=True)
