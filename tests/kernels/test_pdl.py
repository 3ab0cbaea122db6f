"""Programmatic dependent launch (``triton_support/pdl.py``): when a launch asks for it, and how the
recorded launches keep it. The bits of chained kernels with it on and off are compared on a GPU in
``test_fp8_matmul.py`` and ``test_fused_moe.py``."""

from __future__ import annotations

import pytest
import torch


def test_pdl_launch_option_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch_pdl`` is a launch option (kept beside num_warps, never passed as a kernel parameter);
    PDL is asked only on a Hopper+ GPU, never on the CPU or under the interpreter, and
    ``pdl.ENABLED = False`` turns it off."""
    from prefixserve.triton_support import pdl
    from prefixserve.triton_support.launch import record

    class Fake:
        arg_names = ("x", "BLOCK")

    launch = record(Fake(), (2,), (torch.zeros(2),), {"BLOCK": 4, "num_warps": 4, "launch_pdl": True}, None)
    assert launch.options == {"num_warps": 4, "launch_pdl": True} and launch.keywords == ["BLOCK"]
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.device("cuda", 0))
    if torch.cuda.is_available():
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert pdl.enabled(torch.device("cuda", 0)) == (torch.cuda.get_device_capability(0)[0] >= 9)
