"""Every benchmark script and probe imports and answers ``--help`` (no model, no GPU, no measuring).

A script whose import or argument parsing broke would otherwise go unnoticed until the next GPU run.
Scripts with ``run`` / ``report`` sub-commands answer ``--help`` at the top level too. All run in one
subprocess, each as ``python -m benchmarks.NAME --help`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# shared code, not scripts (recovery.py: the sections promptcache.py runs); imported on their own below
LIBRARIES = {
    "harness",
    "recovery",
    "decode_run",
    "promptcache_workload",
    "promptcache_spill",
    "promptcache_tiers",
    "attention_grid",
    "attention_report",
    "host_overhead_report",
    "soak_report",
    "overload_report",
    "tensor_parallel_power",
    "tensor_parallel_files",
    "peers_gpu_batch",
    "peers_gpu_fi",
}


def _scripts() -> list[str]:
    names = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts
        if path.name.startswith("_") or parts[1] in LIBRARIES:
            continue
        if parts[1] == "serving_gpu" and len(parts) > 2:
            continue  # the package: run as benchmarks.serving_gpu
        names.append(".".join(parts))
    return sorted(set(names) | {"benchmarks.serving_gpu"})


SCRIPTS = _scripts()


def test_the_script_list_is_complete() -> None:
    assert "benchmarks.throughput" in SCRIPTS and "benchmarks.probes.split_k" in SCRIPTS
    assert "benchmarks.serving_client" in SCRIPTS


def _library_modules() -> list[str]:
    """The shared modules (``LIBRARIES``, the harness and serving_gpu packages' modules)."""
    mods = [f"benchmarks.{m}" for m in sorted(LIBRARIES)]
    mods += [
        f"benchmarks.harness.{p.stem}" for p in sorted((ROOT / "benchmarks" / "harness").glob("[!_]*.py"))
    ]
    mods += [
        f"benchmarks.serving_gpu.{p.stem}"
        for p in sorted((ROOT / "benchmarks" / "serving_gpu").glob("[!_]*.py"))
    ]
    return mods


# One interpreter imports every shared module first, each on its own (no script pulled in before
# them), then runs every script's ``--help`` as ``python -m`` would (``runpy``, run as __main__):
# torch is imported once, not once a script or once more for the imports. Each module's and each
# script's outcome: "ok", or why not.
RUNNER = """
import contextlib, importlib, io, json, runpy, sys, traceback
args = sys.argv[1:]
cut = args.index("--scripts")
imports, helps = {}, {}
for name in args[:cut]:
    try:
        importlib.import_module(name)
        imports[name] = "ok"
    except BaseException:
        imports[name] = traceback.format_exc()[-2000:]
for name in args[cut + 1:]:
    sys.argv = [name, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        helps[name] = "no usage: --help did not exit"
    except SystemExit as exc:
        ok = exc.code in (0, None) and "usage:" in buf.getvalue()
        helps[name] = "ok" if ok else f"exit {exc.code}: {buf.getvalue()[-500:]}"
    except BaseException:
        helps[name] = traceback.format_exc()[-2000:]
print("RESULTS" + json.dumps({"imports": imports, "help": helps}))
"""


@pytest.fixture(scope="module")
def runner_results() -> dict[str, dict[str, str]]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    scripts = [n for n in SCRIPTS if n != "benchmarks.serving_client"]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *_library_modules(), "--scripts", *scripts],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "RESULTS" in done.stdout, done.stderr[-2000:]
    return dict(json.loads(done.stdout.rsplit("RESULTS", 1)[1]))


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help(name: str, runner_results: dict[str, dict[str, str]]) -> None:
    if name == "benchmarks.serving_client":  # a worker that reads jobs from stdin: no options; it imports
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return
    assert runner_results["help"][name] == "ok"


def _probe_rows(readme: str) -> tuple[set[str], set[str]]:
    """The probes the README's two tables name: (live, removed)."""
    live, removed = set(), set()
    table = live
    for line in readme.splitlines():
        if line.startswith("## Removed probes"):
            table = removed
        if line.startswith("| `") and "`" in line[3:]:
            table.add(line[3 : line.index("`", 3)])
    return live, removed


def test_the_probes_readme_names_each_probe_once() -> None:
    """Every probe in benchmarks/probes/ has its row in the README's live table (the rule it backs and
    where its answer is), and the removed table names only files that are gone: docs that point at a
    probe must find it."""
    files = {p.name for p in (ROOT / "benchmarks" / "probes").glob("[!_]*.py")}
    live, removed = _probe_rows((ROOT / "benchmarks" / "probes" / "README.md").read_text())
    assert files - live == set(), "probes without a README row"
    assert live - files == set(), "README rows for probes that are not there"
    assert removed & files == set(), "probes listed as removed but present"


def test_every_library_module_imports(runner_results: dict[str, dict[str, str]]) -> None:
    """The shared modules import on their own (no script pulled in first)."""
    imports = runner_results["imports"]
    assert list(imports) == _library_modules()
    failed = {name: why for name, why in imports.items() if why != "ok"}
    assert not failed, failed


def _sum_ranks(rank: int, size: int, init: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.harness.ranks import join_group, leave_group

    join_group(rank, size, init, backend="gloo")
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    leave_group(queue, rank, (dist.get_rank(), float(x)))


def test_run_ranks_brings_every_ranks_answer_back() -> None:
    """The probes' and GPU tests' process-per-rank runner, on gloo: each rank joins, answers, leaves
    (two ranks: a third is the same path, and ~3.5 CPU-seconds of its own start)."""
    from benchmarks.harness.ranks import run_ranks

    assert run_ranks(_sum_ranks, size=2, timeout=60) == [(0, 3.0), (1, 3.0)]


def _second_rank_fails(rank: int, size: int, init: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.harness.ranks import join_group, leave_group

    join_group(rank, size, init, backend="gloo")
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that is gone
    leave_group(queue, rank, None)


def test_run_ranks_fails_at_once_when_a_rank_dies() -> None:
    """A rank that raises must fail the run with its rank named, not leave the caller waiting out the
    timeout while the others sit in a collective (a GPU test once hung 300 s that way)."""
    import time

    from benchmarks.harness.ranks import run_ranks

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exit code 1"):
        run_ranks(_second_rank_fails, size=2, timeout=120)
    assert time.monotonic() - started < 60


class _ExitsAt:
    """A stand-in process whose exit code appears ``after`` seconds from now."""

    def __init__(self, code: int | None, after: float) -> None:
        import time

        self.code, self.at = code, time.monotonic() + after

    @property
    def exitcode(self) -> int | None:
        import time

        return self.code if time.monotonic() >= self.at else None


def test_run_ranks_names_the_rank_that_failed_when_a_peer_is_seen_dying_first() -> None:
    """The peer aborted by a lost connection (SIGABRT) can be reaped before the rank that raised; the
    report waits briefly so that both are named (CI once saw only rank 0's -6)."""
    import queue as queue_module

    from benchmarks.harness.ranks import _answers

    procs = [_ExitsAt(-6, 0.0), _ExitsAt(1, 1.5)]  # after the first look at exit codes (1 s in)
    with pytest.raises(RuntimeError, match="rank 0 exit code -6, rank 1 exit code 1"):
        _answers(queue_module.Queue(), procs, timeout=30)


def test_bpe_tokenizer_has_the_configs_vocabulary_and_runs_the_structured_benchmark(tmp_path: Path) -> None:
    """``benchmarks/harness/big_tokenizer.py``: a byte-level BPE of exactly the dummy config's
    vocabulary (Llama 3's 256 specials on top), the same bytes from the same seed, loaded beside the
    config as a dummy model's own tokenizer; the structured-outputs benchmark runs on it end to end
    (tiny model, 2,048 entries: the corpus scales with the size, a second or two to build)."""
    from benchmarks import structured
    from benchmarks.harness import TINY
    from benchmarks.harness.big_tokenizer import SPECIALS, bpe_model, tokenizer_dir, tokenizer_info
    from prefixserve.model.loader import load_tokenizer

    model = bpe_model(TINY | {"vocab_size": 2048}, "tiny", root=tmp_path / "a")
    path = Path(model.partition(":")[2])
    tok = load_tokenizer(path.parent)
    config = json.loads(path.read_text())
    assert len(tok) == 2048 and config["vocab_size"] == 2048
    assert config["bos_token_id"] == tok.bos_token_id == 2048 - SPECIALS
    assert tok.eos_token_id in config["eos_token_id"]
    text = '{"records": [{"name": "Ann", "score": 42, "active": true}]}'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    again = tokenizer_dir(2048, root=tmp_path / "b", log=False)
    assert (
        tokenizer_info(again)["tokenizer_json_sha256"] == tokenizer_info(path.parent)["tokenizer_json_sha256"]
    )

    out = tmp_path / "result"
    structured.main(
        ["--model", "tiny", "--vocab", "2048", "--tokenizer-cache", str(tmp_path / "a"), "--batch", "2",
         "--tokens", "4", "--name", str(out)]
    )  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["tokenizer"]["entries"] == 2048 and result["tokenizer"]["seed"] == 0
    assert all(c["invalid"] == 0 for c in result["check"].values())
    assert "2,048 entries" in out.with_suffix(".md").read_text()


def test_source_trees_name_the_code_as_it_is_not_as_the_stale_head_says(tmp_path: Path) -> None:
    """``run_info``'s ``source_trees``: each source folder's git tree id as the files are now, the
    id ``git rev-parse COMMIT:folder`` gives for a commit holding them, whatever HEAD says (the device
    machine's copy keeps a stale .git); a result written elsewhere does not change it."""
    from benchmarks.harness.info import SOURCE_DIRS, source_trees

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True)
        return run.stdout.strip()

    git("init", "-q")
    for name in SOURCE_DIRS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.py").write_text(f"# {name}\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = source_trees(tmp_path)
    assert first == {name: git("rev-parse", f"HEAD:{name}")[:12] for name in SOURCE_DIRS}
    (tmp_path / "results.json").write_text("{}")  # written by a run: not code
    assert source_trees(tmp_path) == first
    (tmp_path / SOURCE_DIRS[0] / "a.py").write_text("# changed, uncommitted\n")
    (tmp_path / SOURCE_DIRS[0] / "b.py").write_text("# new, untracked\n")
    changed = source_trees(tmp_path)
    assert changed is not None and changed[SOURCE_DIRS[0]] != first[SOURCE_DIRS[0]]
    assert changed[SOURCE_DIRS[1]] == first[SOURCE_DIRS[1]]
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    assert changed[SOURCE_DIRS[0]] == git("rev-parse", f"HEAD:{SOURCE_DIRS[0]}")[:12]
    assert git("status", "--porcelain") == ""  # the checkout's own index was not touched
    assert source_trees(tmp_path / "nowhere") is None
