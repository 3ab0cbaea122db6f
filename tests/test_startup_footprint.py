"""Start-up and footprint (issue 55, item 3): a checkpoint's weights are never drawn at random first,
the default KV pool holds what ``max_num_seqs`` sequences of the context can use and is resident only
as far as it is written, the command line's pool options, and the demo's report of saved KV rows."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixserve.entrypoints import cli
from prefixserve.entrypoints.demo import sharing_report
from prefixserve.kv.cache import pool_zeros
from prefixserve.model.config import ModelConfig
from prefixserve.model.llama import LlamaForCausalLM
from prefixserve.model.loader import ModelSource, load_model
from prefixserve.model.memory_fit import kv_blocks_for_sequences
from prefixserve.model.meta_init import allocate
from tests.conftest import TINY_CONFIG

_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "trunc_normal_")


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An HF-format directory holding the tiny dummy model's weights (stacked q/k/v, gate/up)."""
    from safetensors.torch import save_file

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(dict(TINY_CONFIG, vocab_size=512)))
    model, _ = load_model(ModelSource("dummy", config, "tiny"), torch.float32, torch.device("cpu"), seed=3)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(ModelConfig.to_hf_dict(model.config)))
    return directory, state


def _forbid_random_init(monkeypatch: pytest.MonkeyPatch, tensor_methods: bool) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a weight was initialised at random")

    for name in _INITS:
        monkeypatch.setattr(torch.nn.init, name, fail)
        if tensor_methods and hasattr(torch.Tensor, name):
            monkeypatch.setattr(torch.Tensor, name, fail)


def test_checkpoint_weights_are_not_initialised_at_random(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, state = _checkpoint(tmp_path)
    _forbid_random_init(monkeypatch, tensor_methods=True)
    model, _ = load_model(ModelSource("hf", directory, "ckpt"), torch.float32, torch.device("cpu"))
    loaded = model.state_dict()
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name


def test_dummy_weights_are_still_drawn_and_seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy models skip torch's init too, and draw their own (seeded) weights explicitly."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(dict(TINY_CONFIG, vocab_size=512)))
    _forbid_random_init(monkeypatch, tensor_methods=False)  # _init_dummy draws with Tensor.normal_
    a, _ = load_model(ModelSource("dummy", config, "tiny"), torch.float32, torch.device("cpu"), seed=5)
    b, _ = load_model(ModelSource("dummy", config, "tiny"), torch.float32, torch.device("cpu"), seed=5)
    embed = a.model.embed_tokens.weight
    assert 0.015 < embed.std().item() < 0.025
    assert torch.equal(embed, b.model.embed_tokens.weight)
    assert torch.equal(a.model.layers[1].mlp.down_proj.weight, b.model.layers[1].mlp.down_proj.weight)
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


def test_modules_built_on_a_real_device_keep_torchs_init() -> None:
    from prefixserve.model.linear import Linear

    layer = Linear(64, 64)
    assert layer.weight.abs().sum() > 0 and layer.weight.std() > 0


def test_allocate_keeps_tied_weights_tied() -> None:
    config = ModelConfig.from_hf_dict(dict(TINY_CONFIG, vocab_size=512, tie_word_embeddings=True))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    allocate(model, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_loading_a_checkpoint_imports_no_compiler(tmp_path: Path) -> None:
    """torch's default init and ``to_empty`` on the meta device ran Python decompositions that import
    torch._dynamo and sympy: 2-3 s of a CPU start. Checked in a fresh interpreter."""
    directory, _ = _checkpoint(tmp_path)
    code = (
        "import sys, torch\n"
        "from prefixserve.model.loader import ModelSource, load_model\n"
        f"load_model(ModelSource('hf', __import__('pathlib').Path({str(directory)!r}), 'c'), "
        "torch.float32, torch.device('cpu'))\n"
        "print(sorted({'torch._dynamo', 'sympy'} & set(sys.modules)))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_engine_imports_no_triton_kernel() -> None:
    """A CPU engine never loads a Triton kernel module: the GPU paths import theirs when they run. (The
    kernel tests set TRITON_INTERPRET before importing them; a kernel module imported earlier by an
    engine module was compiled for no interpreter, and every kernel test on that worker failed.)"""
    code = (
        "import sys\n"
        "import prefixserve.engine.llm_engine, prefixserve.worker.model_runner, prefixserve.model.llama\n"
        "print(sorted(m for m in sys.modules if '.kernels' in m and m.startswith('prefixserve.attention')))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_pool_size_is_what_the_sequences_can_hold() -> None:
    assert kv_blocks_for_sequences(8192, 16, 1) == 512
    assert kv_blocks_for_sequences(8192, 16, 3) == 1536
    assert kv_blocks_for_sequences(2049, 16, 2) == 2 * 129  # a partly filled last block counts


def test_cpu_engine_pool_from_max_num_seqs(tiny_config_path: Path) -> None:
    from prefixserve import LLM

    llm = LLM(model=f"dummy:{tiny_config_path}", device="cpu", max_num_seqs=3, progress=False)
    assert llm.engine.runner.num_blocks == 3 * 2048 // 16  # TINY_CONFIG's context: 2048
    bigger = LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=1000, progress=False)
    assert bigger.engine.runner.num_blocks == 1000


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_cpu_pool_is_zero_and_resident_only_where_written() -> None:
    def anon_kib() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
        raise AssertionError("no RssAnon")

    before = anon_kib()
    pool = pool_zeros((64, 1 << 20), torch.float32, torch.device("cpu"))  # 256 MiB
    assert anon_kib() - before < 16 << 10
    pool[3, :1024] = 1.0
    assert pool[3, :1024].sum().item() == 1024 and pool[3, 1024:2048].abs().sum().item() == 0
    assert pool[63, -1].item() == 0 and pool[0, 0].item() == 0
    assert anon_kib() - before < 16 << 10
    half = pool_zeros((2, 3), torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and torch.equal(half, torch.zeros(2, 3, dtype=torch.bfloat16))


def _captured_config(monkeypatch: pytest.MonkeyPatch, argv: list[str], sequences: int | None) -> Any:
    from prefixserve.entrypoints.llm import LLM

    seen: list[Any] = []
    monkeypatch.setattr(LLM, "from_config", classmethod(lambda cls, config: seen.append(config)))
    parser = cli.build_parser()
    args: argparse.Namespace = parser.parse_args(argv)
    cli._make_llm(args, sequences=sequences)
    return seen[0]


def test_cli_pool_options(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _captured_config(monkeypatch, ["generate", "a", "b"], sequences=2 * 3)
    assert config.max_num_seqs == 6 and config.num_kv_blocks is None and config.kv_memory_fraction is None
    config = _captured_config(monkeypatch, ["generate", "a", "--max-num-seqs", "40"], sequences=1)
    assert config.max_num_seqs == 40
    config = _captured_config(monkeypatch, ["generate", "a"], sequences=1000)
    assert config.max_num_seqs == 256  # never more than the engine's default
    argv = ["serve", "--kv-memory-fraction", "0.3", "--num-kv-blocks", "4096"]
    config = _captured_config(monkeypatch, argv, sequences=None)
    assert config.max_num_seqs == 256 and config.kv_memory_fraction == 0.3 and config.num_kv_blocks == 4096


def test_sharing_report_counts_saved_rows() -> None:
    metrics = {
        "prompt_tokens_total": 1014,
        "prefix_cache_hit_tokens_total": 640,
        "module_tokens_reused_total": 0,
        "attention_kv_tokens_read_total": 30_000,
        "attention_kv_tokens_logical_total": 75_000,
        "cascade_steps_total": 5,
        "steps_total": 7,
    }
    line = sharing_report(metrics)
    assert "KV rows read by attention 30,000 of 75,000" in line
    assert "45,000 saved (60%)" in line and "in 5 of 7 steps" in line
