"""Write docs/reference/options.md, every option of the ``prefixserve`` command, from its argument parser
(``prefixserve.entrypoints.cli.build_parser``), so the reference cannot drift from the code.

    python tools/options_reference.py          # rewrite docs/reference/options.md
    python tools/options_reference.py --check  # exit 1 if the file is not what the parser gives

tests/test_docs.py checks that ``render()`` equals the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference" / "options.md"

HEADER = """# Command-line options

Every option of the `prefixserve` command (and `python -m prefixserve`), by subcommand. Generated from
the argument parser (`prefixserve/entrypoints/cli.py`, `args.py`, `serve_args.py`) by
`python tools/options_reference.py`; do not edit by hand (`tests/test_docs.py` checks it is current).
What the options do in practice: the guides in [`docs/guides/`](../guides/). `prefixserve COMMAND --help`
prints the same.
"""


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, tags shown as text, one line."""
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(text.split())


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:  # a flag (store_true, store_false, --x / --no-x)
        return ""
    if action.choices is not None:
        word = " \\| ".join(f"`{c}`" for c in action.choices)
    else:
        type_name = {int: "INT", float: "FLOAT"}.get(action.type, "TEXT")  # type: ignore[call-overload]
        word = f"`{action.metavar or type_name}`"
    return {"?": f"[{word}]", "*": f"[{word} ...]", "+": f"{word} ..."}.get(str(action.nargs), word)


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) and action.default is not None:
        return "on" if action.default else "off"
    if action.nargs == 0 or action.default in (None, [], "", argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    # BooleanOptionalAction appends this on some Python versions; the default column says it
    text = text.removesuffix(" (default: %(default)s)")
    params = {**vars(action), "prog": ""}
    return _cell(text % params if "%" in text else text)


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| option | value | default | what it does |", "| --- | --- | --- | --- |"]
    for a in actions:
        names = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.metavar or a.dest}` (positional)"
        rows.append(f"| {names} | {_value(a)} | {_default(a)} | {_help(a)} |")
    return rows


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """(title, actions) of each argument group with options, help and subcommands left out."""
    out = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        if actions:
            out.append((group.title or "options", actions))
    return out


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of every subcommand, nested ones (``schema add``) included, in order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{prefix} {name}"
                nested = _commands(sub, full)
                out.extend(nested or [(full, helps.get(name, ""), sub)])
    return out


def render() -> str:
    if str(ROOT) not in sys.path:  # run as a script from a checkout that is not installed
        sys.path.insert(0, str(ROOT))
    from prefixserve.entrypoints.cli import build_parser

    commands = _commands(build_parser(), "prefixserve")
    # a group with the same title and rows in several commands (the engine's options) is written once
    seen: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for name, _, parser in commands:
        for title, actions in _groups(parser):
            seen.setdefault((title, tuple(_table(actions))), []).append(name)
    shared = {key: names for key, names in seen.items() if len(names) > 1}
    anchors: dict[tuple[str, tuple[str, ...]], str] = {}
    for key in shared:
        slug = "shared-" + "-".join(key[0].lower().split()[:2]).strip("(),")
        anchors[key] = slug if slug not in anchors.values() else f"{slug}-{len(anchors)}"

    lines = [HEADER, "## Commands", "", "| command | what it does |", "| --- | --- |"]
    lines += [f"| [`{name}`](#{name.replace(' ', '-')}) | {_cell(text)} |" for name, text, _ in commands]
    for name, _, parser in commands:
        lines += ["", f'<a id="{name.replace(" ", "-")}"></a>', "", f"## `{name}`"]
        for title, actions in _groups(parser):
            key = (title, tuple(_table(actions)))
            if key in shared:
                lines += ["", f"{_cell(title[0].upper() + title[1:])}: [below](#{anchors[key]})."]
            else:
                lines += ["", f"### {_cell(title)}", "", *key[1]]
    if shared:
        lines += ["", "## Option groups several commands take"]
    for key, names in shared.items():
        title, rows = key
        taken = ", ".join(f"`{n}`" for n in names)
        lines += ["", f'<a id="{anchors[key]}"></a>', "", f"### {_cell(title)}", ""]
        lines += [f"Taken by {taken}.", "", *rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the file differs, write nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python tools/options_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
