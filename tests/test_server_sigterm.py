"""``prefixserve serve`` as a real process: it serves, and SIGTERM shuts it down cleanly (exit 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from prefixserve.entrypoints.openai.server import free_port

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_sigterm_finishes_in_flight_request_and_exits_zero(
    tiny_config_path: Path, engine_process: str
) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "prefixserve.entrypoints.cli",
        "serve",
        "--model",
        f"dummy:{tiny_config_path}",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--num-kv-blocks",
        "256",
        "--stream-interval",
        "2",
        "--switch-interval-ms",
        "1",
        "--engine-process",
        engine_process,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # one client: ``httpx.get`` makes one (its TLS context with it, ~60 ms of CPU) each poll
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)

        quick = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=5)
        assert quick.status_code == 200, quick.text

        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            # the signal goes at the first event (2 tokens in); the ~100 steps after it (~1 s on the
            # CI machine) are the in-flight request it must finish
            body = {"prompt": "ride", "max_tokens": 100, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(10)
        assert events[-1] == "data: [DONE]"  # the in-flight stream ended cleanly (finished or aborted)
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] in ("length", "abort")
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def test_serve_refuses_a_switch_interval_of_zero(capsys) -> None:
    from prefixserve.entrypoints import cli

    assert cli.main(["serve", "--switch-interval-ms", "0"]) == 2
    assert "--switch-interval-ms must be > 0" in capsys.readouterr().err
