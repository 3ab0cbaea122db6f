"""Where the server's threads spend a streamed chat burst (py-spy over the `on` server of serving_gpu).

Starts the `on` server of ``benchmarks/serving_gpu.py`` (8B dummy model, prefix cache, auto attention),
sends one untimed burst of ``--burst`` streamed chats after an 8K-token system prompt and one timed
(a fresh server), then with ``--after-hydragen`` the document and samples bursts that serving_gpu's
`on` server runs before its chat bursts, then samples the server with ``py-spy record --threads
--format raw`` while a last chat burst runs, and prints per thread the functions with the most samples
(self and inclusive). Needs py-spy on PATH and ptrace rights.

PYTHONPATH=. python -m benchmarks.probes.server_profile --burst 256
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import serving_gpu as sg
from prefixserve.model.loader import tokenizer_for


def top_frames(raw: Path, top: int) -> None:
    """Print per thread the most-sampled leaf frames and the most-sampled frames anywhere on a stack."""
    leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread, calls = frames[0], frames[1:]
        n = int(count)
        total[thread] += n
        if calls:
            leaf[thread][calls[-1]] += n
        for f in set(calls):
            incl[thread][f] += n
    for thread, n in total.most_common():
        print(f"\n== {thread}: {n} samples")
        print("-- self:")
        for f, c in leaf[thread].most_common(top):
            print(f"{c / n:6.1%}  {f[:150]}")
        print("-- inclusive:")
        for f, c in incl[thread].most_common(top):
            print(f"{c / n:6.1%}  {f[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sg.add_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--spy-modes",
        nargs="+",
        default=["active"],
        choices=["active", "idle", "gil"],
        help="one profiled chat burst each: running threads only (py-spy's default), idle threads too "
        "(where the engine thread waits), or only the thread holding the GIL",
    )
    ap.add_argument("--after-hydragen", action="store_true", help="run the document and samples bursts first")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="server_profile_"))
    _, tok = tokenizer_for(args.model, progress=False)
    system = sg.system_prompt(tok, max(args.system_tokens), seed=max(args.system_tokens))
    bursts = [
        sg.chat_requests(tok, system, args.burst, seed, args, None, logprobs=False, tag="b")
        for seed in range(7000, 7002 + len(args.spy_modes))
    ]
    spec = sg.ServerSpec("on", "auto", True, {}, args.hydragen_max_num_seqs)
    clients = sg.Clients(args.clients)
    server = sg.Server(args, spec, workdir)
    try:
        server.start(args.server_timeout)
        sg.server_burst(clients, server, bursts[0], args)
        fresh = sg.server_burst(clients, server, bursts[1], args)
        print(f"fresh server, chat burst: {fresh.get('tok_s', 0):.0f} tok/s; server: {fresh.get('server')}")
        if args.after_hydragen:
            for name, reqs in (
                ("document", sg.doc_requests(tok, args, 9000)),
                ("document", sg.doc_requests(tok, args, 8001)),
                ("samples", sg.sample_requests(tok, args, 9100)),
                ("samples", sg.sample_requests(tok, args, 9200)),
            ):
                run = sg.server_burst(clients, server, reqs, args)
                print(f"{name} burst: {run.get('tok_s', 0):.0f} tok/s", flush=True)
        for i, mode in enumerate(args.spy_modes):
            raw = workdir / f"profile_{mode}.txt"
            assert server.proc is not None
            cmd = [pyspy, "record", "--pid", str(server.proc.pid), "--duration", str(int(args.seconds))]
            cmd += ["--threads", "--format", "raw", "--output", str(raw), "--nonblocking", "--rate", "200"]
            cmd += ["--subprocesses"]  # the engine's own process too (serve's default on a GPU)
            cmd += {"active": [], "idle": ["--idle"], "gil": ["--gil"]}[mode]
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            stats = sg.server_burst(clients, server, bursts[2 + i], args)
            _, err = spy.communicate(timeout=args.seconds + 60)
            tok_s = stats.get("tok_s", 0)
            print(f"\n##### py-spy {mode}: burst {tok_s:.0f} tok/s; server: {stats.get('server')}")
            if not raw.exists():
                print(f"py-spy wrote nothing: {err[-2000:]}")
                continue
            top_frames(raw, args.top)
        print("\n##### graph captures in the server log (start-up ones included):")
        for line in server.log_path.read_text(errors="replace").splitlines():
            if "captured" in line:
                print(line[-160:])
    finally:
        server.stop()
        clients.close()


if __name__ == "__main__":
    main()
