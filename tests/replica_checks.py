"""What the Ray Serve replica tests share: running an application on the session's Ray Serve, waiting
for its replicas, and requests that say which replica (and ingress) answered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from prefixserve.ray_scaleout.serve_ingress import INGRESS_HEADER, REPLICA_HEADER
from tests.conftest import wait_ray_idle


@contextmanager
def app_on_serve(url: str, app: Any, replicas: int) -> Iterator[str]:
    """Run ``app`` (replicas ``replica-0`` ...) on the session's Ray Serve (``url``: the ``ray_serve``
    fixture's), wait until ``replicas`` are healthy; yield its URL. Afterwards the application is
    deleted, and its replicas' processes and engine processes are gone and every Ray CPU is free, so
    the next module's application starts on an idle Ray."""
    from ray import serve

    from prefixserve.ray_scaleout.serve_app import APP_NAME

    wait_ray_idle()
    serve.run(app, name=APP_NAME, route_prefix="/")
    pids: set[int] = set()
    try:
        wait_healthy(url, replicas)
        yield url
    finally:
        for i in range(replicas):
            try:
                info = replica_info(f"replica-{i}")
                pids |= {info["pid"], info["engine_pid"]}
            except Exception:  # a replica the module left dead: Ray Serve ends it with the app
                pass
        serve.delete(APP_NAME)
        wait_ray_idle()
        deadline = time.monotonic() + 60
        while not all(process_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes of the deleted application live on: {pids}"
            time.sleep(0.2)


def wait_healthy(url: str, replicas: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=5.0)
            if r.status_code == 200 and sum(r.json()["replicas"].values()) == replicas:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not all {replicas} replicas healthy within {timeout} s")


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def complete(url: str, prompt: str, max_tokens: int = 4) -> tuple[str, str]:
    """(the replica that answered, the text)."""
    replica, _, text = complete_via(url, prompt, max_tokens)
    return replica, text


def complete_via(url: str, prompt: str, max_tokens: int = 4) -> tuple[str, str, str]:
    """(the replica that answered, the ingress that routed it, the text)."""
    raw = client(url).completions.with_raw_response.create(
        model="default", prompt=prompt, max_tokens=max_tokens
    )
    return raw.headers[REPLICA_HEADER], raw.headers[INGRESS_HEADER], raw.parse().choices[0].text


def long_stream(url: str, prompt: str) -> Any:
    """A streamed completion that runs for a while (4 samples of 1,800 tokens each)."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": 1800,
        "n": 4,
        "stream": True,
        "ignore_eos": True,
    }
    return httpx.stream("POST", url + "/v1/completions", json=body, timeout=60.0)


def started(response: Any) -> Iterator[str]:
    """The stream's lines, after checking that it produced its first event."""
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return lines


def replica_info(name: str) -> dict[str, Any]:
    """A replica's incarnation, its process id and its engine's (``EngineReplica.info``)."""
    from ray import serve

    from prefixserve.ray_scaleout.serve_app import APP_NAME

    handle = serve.get_deployment_handle(name, app_name=APP_NAME)
    return dict(handle.info.remote().result())


def process_gone(pid: int) -> bool:
    """No such process, or a zombie (it exited; nobody reaped it yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status
