"""FP8 (e4m3) KV cache, CPU: the setting, the e4m3 rounding and scales, the pool's size, block digests
that never meet model-dtype ones, and FP8 rows through the host and disk tiers and the prefix spill,
bit for bit (``attention/kv_quant.py``; the attention paths: tests/kernels/test_fp8_kv_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.attention.kv_quant import FP8, FP8_MAX, dequantize, pow2_scales, quantize, scales_of
from prefixserve.config import EngineConfig
from prefixserve.kv.block_pool import BlockPool, chain_digests, chain_root
from prefixserve.kv.cache import KVCache, bytes_per_block
from prefixserve.kv.tiers import DiskTier, HostTier
from tests.test_kv_tiers import TINY


def test_setting_names_its_choices() -> None:
    assert EngineConfig(device="cpu").kv_torch_dtype == torch.float32
    for name in ("fp8", "fp8_e4m3"):
        assert EngineConfig(device="cpu", kv_cache_dtype=name).kv_torch_dtype == FP8
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8_e5m2")


def test_command_line_flag_reaches_the_config() -> None:
    from prefixserve.entrypoints.args import engine_config_from_args
    from prefixserve.entrypoints.cli import build_parser

    for command in ("serve", "generate"):
        args = build_parser().parse_args([command, "--kv-cache-dtype", "fp8"])
        assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])


def test_e4m3_rounding_within_its_precision() -> None:
    """|x - s r(x / s)| <= 2^-4 |x| in e4m3's normal range (3 mantissa bits, round to nearest), and
    s 2^-10 below it; beyond 448 s the value saturates; power-of-two scales leave the rest exact."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 3, 16, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    scales = pow2_scales(x.abs().amax((0, 2)))
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    assert (x.abs().amax((0, 2)) * 2 / scales <= FP8_MAX).all()  # the margin of 2 fits
    back = dequantize(quantize(x, 1 / scales), scales)
    err = (back - x).abs()
    assert err.le(2.0**-4 * x.abs() + 2.0**-10 * scales[:, None]).all()
    assert dequantize(quantize(x * 4, 1 / scales), scales).abs().max() <= FP8_MAX * scales.max()
    assert torch.isfinite(quantize(torch.full((1, 1, 2), float("inf")), torch.ones(1)).float()).all()


@pytest.mark.parametrize("knob", ["kv_memory_fraction", "gpu_memory_utilization"])
def test_fp8_pool_holds_twice_the_tokens(tiny_config_path, knob: str) -> None:
    """The same bytes hold twice the blocks: a block is half the bytes of a bf16 one, so an engine
    sized by a share of memory (on a CPU, of its RAM, which does not move between the two) has twice
    the blocks over e4m3 and reports twice the pool's tokens."""
    from prefixserve.kv.cache import available_memory

    assert 2 * bytes_per_block(TINY, 16, FP8) == bytes_per_block(TINY, 16, torch.bfloat16)
    model = f"dummy:{tiny_config_path}"
    share = 300 * bytes_per_block(TINY, 16, torch.bfloat16) / available_memory(torch.device("cpu"))
    pools = []
    for kv_dtype in ("auto", "fp8"):
        sizing = {"dtype": "bfloat16", "kv_cache_dtype": kv_dtype, knob: share}
        llm = LLM(model, device="cpu", progress=False, **sizing)
        pools.append((llm.engine.runner.num_blocks, llm.metrics()["kv_pool_tokens"]))
    (plain, plain_tokens), (fp8, fp8_tokens) = pools
    assert plain >= 100 and fp8 in (2 * plain, 2 * plain + 1)
    assert fp8_tokens / plain_tokens == fp8 / plain


def test_cache_scales_travel_with_the_layers() -> None:
    cache = KVCache(TINY, 6, 4, FP8, torch.device("cpu"))
    plain = KVCache(TINY, 6, 4, torch.float32, torch.device("cpu"))
    assert plain.scheme == b"" and scales_of(plain.layers[0]) is None
    first = cache.scheme
    scales = torch.rand(3, 2, 2) + 0.5
    cache.set_scales(scales)
    layer = cache.layers[1]
    k_cache, _ = layer  # still a pair
    assert k_cache.dtype == FP8 and torch.equal(scales_of(layer), scales[1])
    assert torch.equal(layer.inverse, 1 / scales[1])
    assert cache.scheme not in (b"", first)  # the scales' identity
    with pytest.raises(ValueError, match="only an fp8"):
        plain.set_scales(scales)


def test_fp8_digests_never_meet_model_dtype_ones() -> None:
    ids, places = list(range(40)), list(range(40))
    plain = chain_digests(None, ids, places, None, 8)
    one = KVCache(TINY, 6, 4, FP8, torch.device("cpu"))
    other = KVCache(TINY, 6, 4, FP8, torch.device("cpu"))
    other.set_scales(torch.full((3, 2, 2), 0.5))
    fp8 = chain_digests(BlockPool(10, 8, one.scheme).root, ids, places, None, 8)
    fp8_other = chain_digests(BlockPool(10, 8, other.scheme).root, ids, places, None, 8)
    assert chain_root(b"") is None and BlockPool(10, 8).root is None  # model-dtype digests unchanged
    assert not set(plain) & set(fp8) and not set(fp8) & set(fp8_other)


def _random_fp8_cache(seed: int) -> KVCache:
    cache = KVCache(TINY, 10, 4, FP8, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    cache.tensor.view(torch.uint8).copy_(torch.randint(0, 256, cache.tensor.shape, generator=gen))
    return cache


def test_tiers_round_trip_fp8_rows_bit_for_bit(tmp_path) -> None:
    """gather -> host tier / disk file -> scatter into other blocks: the same bytes (every pattern,
    NaN ones included), half the bytes of bf16 rows; a model-dtype entry does not fit an FP8 cache."""
    src, dst = _random_fp8_cache(1), _random_fp8_cache(2)
    packed = src.gather_rows([5, 1, 7], 10)
    assert packed.dtype == FP8 and packed.element_size() == 1
    host, disk = HostTier(1 << 20, pin=False), DiskTier(tmp_path)
    host.put("a", packed)
    disk.put("a", packed, {"m": "1"})
    from_host = host.get("a")[0]
    from_disk, meta = disk.get("a")
    assert meta == {"m": "1"}
    for got, blocks in ((from_host, [2, 8, 0]), (from_disk, [3, 4, 9])):
        dst.scatter_rows(blocks, got)
        back = dst.gather_rows(blocks, 10)
        assert torch.equal(back.view(torch.uint8), packed.view(torch.uint8))
    with pytest.raises(ValueError, match="dtype"):
        dst.scatter_rows([2, 8, 0], packed.view(torch.uint8).to(torch.bfloat16))


def test_spilled_fp8_blocks_come_back_bit_for_bit(tiny_config_path) -> None:
    """The prefix spill moves FP8 blocks to host memory and back: greedy outputs as without it."""
    from tests.test_prefix_spill import run

    _, want = run(tiny_config_path, spill=False, kv_cache_dtype="fp8")
    llm, got = run(tiny_config_path, spill=True, kv_cache_dtype="fp8")
    assert llm.metrics()["prefix_cache_host_hit_tokens_total"] > 0
    assert llm.engine.runner.kv.tensor.dtype == FP8
    assert got == want


def test_checkpoint_kv_scales_replace_the_calibration(tmp_path) -> None:
    """vLLM's ``v_scale`` in an HF checkpoint (a scalar, or one per KV head) becomes the cache's V
    scales, rounded up to powers of two; with some layer's missing the calibration runs; K's scales
    are always the calibration's (the cache stores K rotated, which a ``k_scale`` does not describe);
    a model-dtype cache ignores them; a checkpoint with V's alone has them taken."""
    from safetensors.torch import load_file, save_file

    from prefixserve.model.loader import ModelSource, load_model
    from prefixserve.worker.kv_calibration import calibrate_kv_scales, checkpoint_scales
    from tests.test_fused_model import _hf_dir

    directory = _hf_dir("llama", tmp_path)  # 2 layers, 2 KV heads
    (file,) = directory.glob("*.safetensors")
    weights = load_file(str(file))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25, 3.0])
    weights["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor([2.0])  # the older name
    save_file(weights, str(file), metadata={"format": "pt"})
    model, _ = load_model(ModelSource("hf", directory, "llama"), torch.float32, torch.device("cpu"))
    cache = KVCache(model.config, 4, 4, FP8, torch.device("cpu"))
    assert checkpoint_scales(model, cache) is None  # layer 1 has no v_scale: calibrated
    calibrate_kv_scales(model, cache, torch.float32)
    assert torch.equal(cache.scales, torch.exp2(torch.log2(cache.scales).round()))  # the calibration's
    calibrated = cache.scales.clone()
    model.checkpoint_kv_scales[(1, 1)] = torch.tensor([1.5])
    calibrate_kv_scales(model, cache, torch.float32)
    # rounded up to powers of two (folding them into bf16 q and outputs is exact): 3.0 -> 4, 1.5 -> 2
    assert torch.equal(cache.scales[:, 1], torch.tensor([[0.25, 4.0], [2.0, 2.0]]))
    assert torch.equal(cache.scales[:, 0], calibrated[:, 0])
    for layer in (0, 1):  # a checkpoint that publishes V's scales alone: they are taken
        del model.checkpoint_kv_scales[(layer, 0)]
    calibrate_kv_scales(model, cache, torch.float32)
    assert torch.equal(cache.scales[:, 1], torch.tensor([[0.25, 4.0], [2.0, 2.0]]))
    assert torch.equal(cache.scales[:, 0], calibrated[:, 0])


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "fp8-block"])
def test_an_fp8_weight_checkpoints_v_scales_are_read(fmt: str, tmp_path) -> None:
    """A published FP8-weight checkpoint that carries ``k_scale`` / ``v_scale`` beside its weights'
    scales (as vLLM's FP8 checkpoints with an FP8 KV cache do): V's reach the cache, rounded up to a
    power of two, and the weights still load as FP8."""
    from safetensors.torch import load_file, save_file

    from prefixserve.model import fp8, linear
    from prefixserve.model.loader import ModelSource, load_model
    from prefixserve.worker.kv_calibration import calibrate_kv_scales
    from tests import fp8_checkpoints as ckpt

    quant, _ = ckpt.write(tmp_path, fmt)
    weights = load_file(str(quant / "model.safetensors"))
    for layer in range(ckpt.CONFIG["num_hidden_layers"]):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(3.0)
    save_file(weights, str(quant / "model.safetensors"))
    model, _ = load_model(ModelSource("hf", quant, fmt), torch.float32, torch.device("cpu"))
    assert all(fp8.is_fp8(layer) for _, layer in linear.quantized_layers(model))
    cache = KVCache(model.config, 4, 4, FP8, torch.device("cpu"))
    calibrate_kv_scales(model, cache, torch.float32)
    assert torch.equal(cache.scales[:, 1], torch.full_like(cache.scales[:, 1], 4.0))


def test_prompt_cache_module_files_hold_fp8_as_it_is(tiny_config_path, tmp_path) -> None:
    """FP8 module KV goes to disk as e4m3 (a quarter of fp32's bytes) and comes back for a restarted
    FP8 engine with the same outputs; a model-dtype engine on the same store never reads it."""
    from prefixserve.kv.kvfile import parse_header
    from tests.test_prompt_cache import GREEDY, PROMPTS, SCHEMA, tiny, token_ids

    store = str(tmp_path / "modules")
    first = tiny(tiny_config_path, module_store=store, kv_cache_dtype="fp8")
    first.register_schema(SCHEMA)
    want = token_ids(first.generate(PROMPTS, GREEDY))
    files = sorted((tmp_path / "modules").glob("*.kv"))
    assert files and all(parse_header(f.read_bytes()).dtype == FP8 for f in files)
    second = tiny(tiny_config_path, module_store=store, kv_cache_dtype="fp8")
    second.register_schema(SCHEMA)
    assert second.metrics()["module_loads_disk_total"] == len(files)
    assert token_ids(second.generate(PROMPTS, GREEDY)) == want
    plain = tiny(tiny_config_path, module_store=store)
    plain.register_schema(SCHEMA)
    assert plain.metrics()["module_loads_disk_total"] == 0
    assert plain.metrics()["module_encodes_total"] == len(files)


def test_fp8_module_files_of_another_model_dtype_are_not_read(tiny_config_path, tmp_path) -> None:
    """An fp32 and a bf16 engine calibrate the same power-of-two scales and both store e4m3, but their
    codes differ (the KV was computed in another dtype): the scheme, and so a module's key and a
    block's digest, names the model's dtype, so the bf16 engine encodes its modules itself."""
    from tests.test_prompt_cache import GREEDY, PROMPTS, SCHEMA, tiny

    store = str(tmp_path / "modules")
    fp32 = tiny(tiny_config_path, module_store=store, kv_cache_dtype="fp8")
    fp32.register_schema(SCHEMA)
    fp32.generate(PROMPTS, GREEDY)
    files = sorted((tmp_path / "modules").glob("*.kv"))
    bf16 = tiny(tiny_config_path, module_store=store, kv_cache_dtype="fp8", dtype="bfloat16")
    bf16.register_schema(SCHEMA)
    kv32, kv16 = fp32.engine.runner.kv, bf16.engine.runner.kv
    assert torch.equal(kv32.model_scales, kv16.model_scales) and kv32.scheme != kv16.scheme
    assert bf16.metrics()["module_loads_disk_total"] == 0
    assert bf16.metrics()["module_encodes_total"] == len(files)


def test_fp8_under_tensor_parallelism(tiny_config_path) -> None:
    """Two ranks, each calibrating its KV heads: greedy tokens as one process's, packed FP8 rows
    (every head: the ranks' joined as bytes) round-trip bit for bit, and the scheme names every
    rank's scales joined, as one process's names them (digests alike whatever the rank count)."""
    ids = [[5, 17, 300, 42, 7, 99, 1000, 3] * 5, [8, 9, 10]]
    prompts = [{"prompt_token_ids": p} for p in ids]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kwargs = dict(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        num_kv_blocks=128,
        progress=False,
        kv_cache_dtype="fp8",
    )
    single = LLM(**kwargs)
    with LLM(tensor_parallel_size=2, **kwargs) as tp:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, greedy)]
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)] == want
        blocks = tp.engine.pool.allocate(2), single.engine.pool.allocate(2)
        packed = single.engine.kv.gather_rows(blocks[1], 20)
        assert packed.dtype == FP8 and packed.shape[3] == 2
        assert tp.engine.kv.scheme == single.engine.kv.scheme
        assert tp.engine.pool.root == single.engine.pool.root is not None
        tp.engine.kv.scatter_rows(blocks[0], packed)
        assert torch.equal(
            tp.engine.kv.gather_rows(blocks[0], 20).view(torch.uint8), packed.view(torch.uint8)
        )


@pytest.mark.parametrize("size", [2, 4])
def test_joined_scales_name_each_kv_head_once(tiny_config_path, size: int) -> None:
    """``KVCache.join_scales``: each rank's span of the KV heads in head order; with more ranks than
    KV heads (4 ranks, 2 heads: each head on two ranks) every head is taken once."""
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.parallel import Shard

    config = ModelConfig.from_json(tiny_config_path)
    total = config.num_key_value_heads
    per_rank, caches = [], []
    for rank in range(size):
        shard = Shard(rank=rank, size=size)
        kv = KVCache(shard.local_config(config), 4, 16, FP8, torch.device("cpu"), shard, total)
        start, stop = shard.kv_head_span(total)
        heads = torch.arange(start, stop, dtype=torch.float32)
        scales = torch.exp2(heads)[None, None, :].expand_as(kv.scales).clone()
        kv.set_scales(scales)
        per_rank.append(scales)
        caches.append(kv)
    for kv in caches:
        kv.join_scales(per_rank)
        want = torch.exp2(torch.arange(total, dtype=torch.float32)).expand(*kv.scales.shape[:2], total)
        assert torch.equal(kv.model_scales, want)
    assert len({kv.scheme for kv in caches}) == 1


def test_kv_shared_layers_read_with_the_scales_their_cache_was_written_with(tmp_path) -> None:
    """Gemma 4's KV-shared layers read an earlier layer's cache: with a checkpoint ``v_scale`` for every
    layer (as vLLM writes them), a reader's own must not replace the writer's, or its V codes come back
    scaled by another factor (64x here)."""
    from safetensors.torch import load_file, save_file

    from prefixserve.model.config import ModelConfig
    from tests.test_model_families import _llm, tiny_checkpoint

    tiny_checkpoint("gemma4_shared", tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    weights = load_file(str(file))
    prefix = next(k for k in weights if ".layers.0." in k).split("layers.0.")[0]
    config = ModelConfig.from_json(tmp_path / "config.json")
    readers = [i for i in range(config.num_hidden_layers) if config.kv_source(i) != i]
    assert readers
    for i in range(config.num_hidden_layers):
        weights[f"{prefix}layers.{i}.self_attn.k_scale"] = torch.tensor(1.0)
        weights[f"{prefix}layers.{i}.self_attn.v_scale"] = torch.tensor(16.0 if i in readers else 0.25)
    save_file(weights, str(file), metadata={"format": "pt"})
    kv = _llm(tmp_path, kv_cache_dtype="fp8").engine.runner.kv
    for i in readers:
        assert torch.equal(scales_of(kv.layers[i]), scales_of(kv.layers[config.kv_source(i)]))
    assert all(float(scales_of(kv.layers[i])[1].max()) == 0.25 for i in range(config.num_hidden_layers))


def test_a_hybrids_checkpoint_v_scales_on_its_attention_layers_are_used(tmp_path) -> None:
    """A linear-attention hybrid's checkpoint has KV scales for the layers that write KV only; they are
    used (the linear layers, which read none, take a writer's), not dropped for the calibration's."""
    from safetensors.torch import load_file, save_file

    from prefixserve.model.config import ModelConfig
    from tests.test_hybrid_families import tiny_checkpoint
    from tests.test_model_families import _llm

    tiny_checkpoint("qwen3_next", tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    weights = load_file(str(file))
    config = ModelConfig.from_json(tmp_path / "config.json")
    writers = [i for i in range(config.num_hidden_layers) if config.kv_source(i) == i]
    assert 0 < len(writers) < config.num_hidden_layers
    for i in writers:
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(1.0)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(3.0)  # rounded up: 4
    save_file(weights, str(file), metadata={"format": "pt"})
    kv = _llm(tmp_path, kv_cache_dtype="fp8").engine.runner.kv
    assert all(torch.all(scales_of(kv.layers[i])[1] == 4.0) for i in writers)
