"""lm-evaluation-harness as a client: its ``local-completions`` model (loglikelihoods through echo and
prompt logprobs, the remote tokenizer through /tokenize) on the local task in examples/lm_eval against
a live server, equal to its ``hf`` backend on the same GGUF; ``local-chat-completions`` for the
generation task. Offline: the task reads a JSONL in the repository, nothing comes from a hub."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefixserve import LLM
from prefixserve.entrypoints.openai.server import ServerThread, build_app

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is in the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "lm_eval"
LIMIT = 4


@pytest.fixture(scope="module")
def server(default_llm: LLM) -> Iterator[ServerThread]:
    """The session's default-model engine (fp32, reference attention) behind a live server."""
    with ServerThread(build_app(engine=default_llm.engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tasks() -> object:
    """The tasks in examples/lm_eval alone: indexing lm-eval's own thousands of task files takes
    longer than the evaluations (and again for every ``TaskManager``)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository root


def _evaluate(model: object, task: str, manager: object, **kw: object) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=model, tasks=[task], task_manager=manager, limit=LIMIT, log_samples=True, **kw
    )


def _loglikelihoods(result: dict, task: str) -> list[list[float]]:
    """Per document, each choice's loglikelihood as lm-eval scored it."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] for r in s["filtered_resps"]] for s in samples]


def test_local_completions_equals_the_hf_backend(
    server: ServerThread, tasks: object, hf_gguf_model: torch.nn.Module, offline: None
) -> None:
    from lm_eval.models.huggingface import HFLM

    task = "prefixserve_capitals_mc"
    args = {
        "base_url": f"{server.url}/v1/completions",
        "model": "default",
        "num_concurrent": 4,  # batched on the server, as lm-eval users run it
        "max_retries": 1,
        "tokenized_requests": True,  # token-id prompts, encoded by the server's /tokenize
    }
    ours = _evaluate("local-completions", task, tasks, model_args=args)
    tokenizer = server.engine_loop.engine.tokenizer
    # the task's 16 loglikelihood requests in one padded batch (one at a time took ~2 CPU-s more; the
    # largest difference from ours, 4.3e-5, was the same either way)
    hf_model = HFLM(pretrained=hf_gguf_model, tokenizer=tokenizer, batch_size=16, device="cpu")
    hf = _evaluate(hf_model, task, tasks)
    acc, hf_acc = ours["results"][task]["acc,none"], hf["results"][task]["acc,none"]
    assert abs(acc - hf_acc) * LIMIT <= 1, (acc, hf_acc)  # within one document
    assert acc >= 0.5  # the model knows most capitals: the scores are not noise
    got, want = _loglikelihoods(ours, task), _loglikelihoods(hf, task)
    assert len(got) == LIMIT
    diff = (torch.tensor(got) - torch.tensor(want)).abs().max().item()
    assert diff < 1e-3, diff


def test_local_chat_completions_runs_the_generation_task(
    server: ServerThread, tasks: object, offline: None
) -> None:
    task = "prefixserve_capitals_gen"
    args = {
        "base_url": f"{server.url}/v1/chat/completions",
        "model": "default",
        "num_concurrent": 4,  # batched on the server, as lm-eval users run it
        "max_retries": 1,
        "tokenizer_backend": None,
    }
    result = _evaluate("local-chat-completions", task, tasks, model_args=args, apply_chat_template=True)
    samples = result["samples"][task]
    assert len(samples) == LIMIT
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples)
    assert result["results"][task]["exact_match,strip"] >= 0.5
    assert os.environ["HF_HUB_OFFLINE"] == "1"
