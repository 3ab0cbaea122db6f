"""``benchmarks/tensor_parallel.py``'s result files: which run wrote each part (``runs``), each grid
cell's and compare row's commit, and ``--merge``, which takes parts of another file with their runs."""

from __future__ import annotations

from pathlib import Path

from benchmarks.decode_run import MODES

RUN_KEYS = ("device", "gpus", "torch", "commit", "date")


def runs_of(result: dict) -> dict[str, dict]:
    """Which run wrote each part of a result file; a file from before ``runs`` gets its one run's."""
    if "runs" in result:
        return dict(result["runs"])
    parts = [p for p in ("grid", "compare", "allreduce") if result.get(p)]
    return {p: {k: result.get(k) for k in RUN_KEYS} for p in parts}


def stamp_cells(result: dict) -> None:
    """Give each measured grid cell (a row's mode) and each compare row without a commit the commit of
    the run that wrote that part: rows of several runs then keep their own after a later run or merge."""
    runs = runs_of(result)
    commit = runs.get("grid", {}).get("commit")
    for row in result.get("grid", []):
        for mode in MODES:
            if f"{mode}_tok_s" in row and f"{mode}_commit" not in row and commit:
                row[f"{mode}_commit"] = commit
    commit = runs.get("compare", {}).get("commit")
    for row in result.get("compare", []):
        if "commit" not in row and commit:
            row["commit"] = commit


def check_same_machine(part: str, mine: dict | None, theirs: dict | None, source: Path) -> None:
    """Refuse to mix one part's numbers from two kinds of machine (H100 and H200 tables stay apart)."""
    if not mine or not theirs:
        return
    here, there = (mine.get("device"), mine.get("gpus")), (theirs.get("device"), theirs.get("gpus"))
    if here != there:
        raise SystemExit(
            f"--merge: {source}'s {part} ran on {there[0]} x {there[1]}, this file's on "
            f"{here[0]} x {here[1]}; results of different machines go to different files (--out)"
        )


def later_run(part: str, mine: dict | None, theirs: dict) -> dict:
    """The run a merged part names: the merged file's, except that a part merged cell by cell or row
    by row (each naming its commit) keeps the later of the two, so its "latest run" stays true."""
    if part in ("grid", "compare") and mine and str(mine.get("date")) > str(theirs.get("date")):
        return mine
    return theirs


def merge_cells(
    payload: dict, other: dict, batches: set[int], prefixes: set[int], modes: list[str]
) -> list[dict]:
    """Copy the grid cells of ``other`` named by B, P and mode (every field of that mode) into ``payload``;
    returns the rows of ``other`` they came from."""
    taken = []
    for src in other.get("grid", []):
        if src["B"] not in batches or src["P"] not in prefixes:
            continue
        row = next((x for x in payload["grid"] if (x["B"], x["P"]) == (src["B"], src["P"])), None)
        if row is None:
            row = {"B": src["B"], "P": src["P"]}
            payload["grid"].append(row)
        shared = ("tp", "max_batched_tokens", "kv_blocks_total")
        row.update({k: v for k, v in src.items() if k in shared or any(k.startswith(f"{m}_") for m in modes)})
        if "auto" in modes:  # the sharing-on run's own fields
            row.update({k: src[k] for k in ("host_overhead_frac", "graphs_captured") if k in src})
        taken.append({k: v for k, v in src.items() if any(k.startswith(f"{m}_") for m in modes)})
    payload["grid"].sort(key=lambda x: (x["B"], x["P"]))
    return taken


def merge_parts(
    payload: dict,
    other: dict,
    parts: list[str],
    batches: list[int],
    prefixes: list[int],
    modes: list[str],
    source: Path,
) -> None:
    """Take ``parts`` of the result file ``other`` (read from ``source``) into ``payload``: grid cells by
    B, P and mode, compare rows by B, other parts whole, each with the run that measured it."""
    other_runs = runs_of(other)
    stamp_cells(other)
    for part in parts:
        check_same_machine(part, payload["runs"].get(part), other_runs.get(part), source)
        if part == "grid":  # cell by cell: the --batches x --prefixes rows' --modes
            taken = merge_cells(payload, other, set(batches), set(prefixes), modes)
            if any(k.endswith("_boards") for row in taken for k in row):  # its ceilings go with them
                payload["power"] = other.get("power") or payload["power"]
        elif part == "compare":  # row by row: the --batches rows
            kept = [r for r in payload["compare"] if r["B"] not in batches]
            taken = [r for r in other.get("compare", []) if r["B"] in batches]
            payload["compare"] = sorted(kept + taken, key=lambda r: r["B"])
        else:
            payload[part] = other.get(part, payload[part])
        if part in other_runs:
            payload["runs"][part] = later_run(part, payload["runs"].get(part), other_runs[part])
