"""The command line: help texts, a real generate on the default model, clear errors.

The commands run in this process (``main``), their output captured: a process of their own would
import torch again for each; ``python -m prefixserve`` itself runs as one below."""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixserve.entrypoints.cli import main


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``prefixserve ARGS`` here; its standard output (it must exit 0)."""
    capsys.readouterr()
    assert main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_generate_on_the_default_model_shows_prefix_reuse(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's questions share a system prompt long enough for shared-segment attention to run;
    its report line says how many KV rows that saved (the engine's counters)."""
    stdout = _run(capsys, "generate", "--max-tokens", "6", "--num-kv-blocks", "256")
    assert stdout.count(">>> ") == 3
    report = re.search(
        r"from prefix cache (\S+)\n.*?of (\S+) a per-sequence path reads: (\S+) saved.*"
        r"shared-segment attention in (\d+) of (\d+) steps",
        stdout,
        re.S,
    )
    assert report, stdout
    hits, logical, saved, cascade, steps = (int(g.replace(",", "")) for g in report.groups())
    assert hits > 0 and saved > 0 and 0 < cascade <= steps
    assert saved > logical // 3  # most of the three questions' KV is the shared system prompt


def test_bench_prints_a_table(tiny_config_path, capsys: pytest.CaptureFixture[str]) -> None:
    stdout = _run(
        capsys,
        "bench",
        "--num-requests",
        "4",
        "--prefix-len",
        "64",
        "--suffix-len",
        "8",
        "--output-len",
        "4",
        "--num-kv-blocks",
        "128",
        "--model",
        f"dummy:{tiny_config_path}",
        "--json",
        str(tiny_config_path.parent / "b.json"),
    )
    for key in ("output_tokens_per_s", "prefix_cache_hit_rate", "kv_read_saving_x"):
        assert key in stdout
    import json

    report = json.loads((tiny_config_path.parent / "b.json").read_text())
    assert report["prefix_cache_hit_rate"] > 0.5  # 3 of 4 requests find the 64-token prefix cached


def test_bad_arguments_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/no/such/model.gguf"]) == 2
    assert "never downloads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--temperature", "warm"])
    assert exc.value.code == 2
    assert main(["generate", "--file", "/no/such/file.txt"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "x", "--system-prompt", "nofile"]) == 2
    assert "NAME=FILE" in capsys.readouterr().err


def test_chat_streams_a_reply_and_exits_on_eof(
    tiny_config_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop (stream, /reset, EOF) on the tiny model: the command, not the model, is under test
    (the generate test above runs the default model)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hello.\n/reset\nAnd again?\n"))
    model = f"dummy:{tiny_config_path}"
    stdout = _run(capsys, "chat", "--max-tokens", "6", "--num-kv-blocks", "128", "--model", model)
    assert stdout.count("bot> ") == 2
    replies = [line.split("bot> ", 1)[1] for line in stdout.splitlines() if "bot> " in line]
    assert all(r.strip() for r in replies)


def test_python_dash_m_prefixserve_is_the_console_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "prefixserve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: prefixserve")
    for command in ("generate", "chat", "bench", "serve"):
        assert command in result.stdout

    # and it calls the function the console script names in pyproject.toml
    import prefixserve.__main__ as dunder_main

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    target = re.search(r'^prefixserve = "([\w.]+):(\w+)"$', pyproject, re.M)
    assert target is not None
    module, func = target.groups()
    assert dunder_main.main is getattr(importlib.import_module(module), func)
