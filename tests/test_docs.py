"""The docs stay true to the tree: the options reference is what the parser gives, every relative link
resolves, the README stays a front door, its test command is the one CI runs, and the metrics guide
names every metric the server exports."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 300

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)[^`\n].*?\1")
_INLINE = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HTML = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"")


def _options_reference() -> object:
    script = ROOT / "tools" / "options_reference.py"
    spec = importlib.util.spec_from_file_location("options_reference", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_reference_is_generated_from_the_parser() -> None:
    """docs/reference/options.md is what tools/options_reference.py writes from today's parser."""
    written = (ROOT / "docs" / "reference" / "options.md").read_text()
    assert _options_reference().render() == written, (  # type: ignore[attr-defined]
        "docs/reference/options.md is stale: run python tools/options_reference.py"
    )


def _links(text: str) -> list[str]:
    """The link targets of a Markdown text, code blocks and code spans left out."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return [m.group(1) for pattern in (_INLINE, _REFERENCE, _HTML) for m in pattern.finditer(text)]


def test_link_finder() -> None:
    text = '[a](x.md) ![b](img/y.png "t") [c](#here) `[d](no.md)`\n```\n[e](no2.md)\n```\n[f]: ref.md\n'
    assert _links(text) == ["x.md", "img/y.png", "#here", "ref.md"]


def test_relative_links_resolve() -> None:
    """Every relative link in README.md and docs/**/*.md names a file or folder that exists (anchors
    are not checked; web links are skipped)."""
    broken = []
    for doc in DOCS:
        for target in _links(doc.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue  # http(s), mailto, ...; an anchor in the same file
            path = target.split("#", 1)[0].split("?", 1)[0]
            base = ROOT if path.startswith("/") else doc.parent
            if not (base / path.lstrip("/")).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == [], "links to nothing:\n" + "\n".join(broken)


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md grew: move the detail into docs/guides/"
    assert "../shared" not in text
    assert "DESIGN.md" not in text


def test_readme_test_command_is_what_ci_runs() -> None:
    """.ci/run runs the Quickstart's test command, as written there."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(ci) == 1
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1]
    assert ci[0] in quickstart.splitlines()


def test_metrics_guide_names_every_server_metric() -> None:
    """docs/guides/metrics.md has a row for every metric family the server's /metrics exports."""
    from prefixserve.entrypoints.openai import metrics

    names = [f"{metrics.PREFIX}_{key}" for key in metrics._COUNTERS]
    names += [f"{metrics.PREFIX}_{name}" for name, _ in metrics._GAUGES.values()]
    names += [f"{metrics.PREFIX}_{name}" for name, _ in metrics.PATH_STAGES.values()]
    guide = (ROOT / "docs" / "guides" / "metrics.md").read_text()
    missing = [name for name in names if f"`{name}" not in guide]
    assert missing == [], f"metrics without a row in docs/guides/metrics.md: {missing}"
