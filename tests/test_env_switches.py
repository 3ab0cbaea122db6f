"""The environment switches: exactly two PREFIXSERVE_* variables, read only in prefixserve/config.py.

Each switch is a function of ``prefixserve.config`` that reads its variable when called, so a test (or a
benchmark) that sets the variable sees the effect on the next call; a value outside the documented ones
raises ValueError naming the variable.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from prefixserve import config

PACKAGE = Path(config.__file__).resolve().parent
SWITCHES = {"PREFIXSERVE_CACHE", "PREFIXSERVE_MIXED"}  # issue 101: the cache and at most one more


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PREFIXSERVE_CACHE", raising=False)
    assert config.cache_dir() == Path.home() / ".cache" / "prefixserve"
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path))
    assert config.cache_dir() == tmp_path
    from prefixserve.model.loader import cache_root

    assert cache_root() == tmp_path  # the loader asks config, at call time
    monkeypatch.setenv("PREFIXSERVE_CACHE", "  ")
    with pytest.raises(ValueError, match="PREFIXSERVE_CACHE"):
        config.cache_dir()


def test_mixed_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXSERVE_MIXED", raising=False)
    assert config.mixed_mode() == "auto"
    for value in ("auto", "0", "1"):
        monkeypatch.setenv("PREFIXSERVE_MIXED", value)
        assert config.mixed_mode() == value
    for bad in ("on", "128", "AUTO"):
        monkeypatch.setenv("PREFIXSERVE_MIXED", bad)
        with pytest.raises(ValueError, match="PREFIXSERVE_MIXED"):
            config.mixed_mode()


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_only_the_two_switches_are_named_in_the_package() -> None:
    """A third PREFIXSERVE_* name anywhere in the package (code, comment or docstring) fails here:
    add it to config.py, with its function and docstring, and to SWITCHES, or do without it."""
    names: dict[str, list[str]] = {}
    for path in _sources():
        for name in re.findall(r"PREFIXSERVE_[A-Z0-9_]+", path.read_text()):
            names.setdefault(name, []).append(str(path.relative_to(PACKAGE.parent)))
    extra = {name: files for name, files in names.items() if name not in SWITCHES}
    assert not extra, f"PREFIXSERVE_* names outside the two switches: {extra}"
    config_text = (PACKAGE / "config.py").read_text()
    assert all(f'"{name}"' in config_text for name in SWITCHES)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and of its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_switches_are_read_only_in_config() -> None:
    """Outside config.py a switch may be mentioned in comments and docstrings, never as a string in
    code (which is how an environment read would name it)."""
    readers = []
    for path in _sources():
        if path == PACKAGE / "config.py":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "PREFIXSERVE_" in node.value
                and id(node) not in docs
            ):
                readers.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not readers, f"PREFIXSERVE_* read outside prefixserve/config.py: {readers}"
