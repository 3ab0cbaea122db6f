"""Structured decoding on a GPU: the matcher process fills the shared host slots, pinned in place
(``bitmask.SharedSlots``), read by the mask kernel once the device's wait saw the fill's flag
(``gate.py``) under CUDA graphs and launch-ahead; every constrained row's tokens follow the grammar and
equal the same engine's with the host waiting for the fill and copying the mask (``GATED`` off) and
with the masks staged through a pinned copy (the fallback where pinning the shared file fails). The
gate's kernel alone: ``tests/kernels/test_fill_gate.py``. Skipped without CUDA."""

from __future__ import annotations

import re

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.structured_outputs import StructuredOutputs
from tests.conftest import assert_pool_empty

xgr = pytest.importorskip("xgrammar")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = StructuredOutputs(regex=r"[0-9]{2,6}(-[ab]{2,5}){1,3}")


def _run(config_path, staged: bool, monkeypatch, gated: bool = True) -> list[tuple[list[int], str, str]]:
    from prefixserve.structured import bitmask, decoding

    if staged:
        monkeypatch.setattr(bitmask, "_pin", lambda t: False)
    monkeypatch.setattr(decoding, "GATED", gated)
    llm = LLM(f"dummy:{config_path}", device="cuda", dtype="float32", async_scheduling=True, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SPEC)
    outs = llm.generate([f"the code of item {i} is" for i in range(24)], params)
    sd = llm.engine.structured
    assert sd.masks._pinned is not staged
    assert sd.fills_ahead > 10, sd.fills_ahead
    assert sd.gated is (gated and not staged)
    for o in outs:  # every token allowed by the grammar, replayed on a matcher here
        matcher = xgr.GrammarMatcher(sd.grammars.get(SPEC))
        assert all(matcher.accept_token(t) for t in o.outputs[0].token_ids), o.outputs[0].text
    assert_pool_empty(llm)
    llm.shutdown()
    return [(list(c.token_ids), c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_pinned_shared_slots_mask_as_a_staged_copy_does(tiny_config_path, monkeypatch) -> None:
    pinned = _run(tiny_config_path, False, monkeypatch)
    host = _run(tiny_config_path, False, monkeypatch, gated=False)
    staged = _run(tiny_config_path, True, monkeypatch)  # last: ``_pin`` stays patched
    assert pinned == host == staged
    ended = [text for _, text, reason in pinned if reason == "stop"]
    assert all(re.fullmatch(SPEC.regex, text) for text in ended), ended
