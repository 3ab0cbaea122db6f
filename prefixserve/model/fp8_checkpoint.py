"""FP8 checkpoints as published, and ``quantization="fp8"`` of unquantized ones: what the loader
keeps of them (``model/fp8.py`` multiplies them).

Formats read (``config.json``'s ``quantization_config``; the checkpoint's own wins over the flag):

- ``quant_method: "fp8"`` (DeepSeek-V3 / Qwen3 FP8): ``weight`` float8_e4m3fn [N, K] and
  ``weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)] with ``weight_block_size: [128, 128]``
  (w = code * scale_inv per block); without a block size one ``weight_scale`` per tensor (and a
  static ``input_scale`` if ``activation_scheme: "static"``).
- ``quant_method: "compressed-tensors"``, format ``float-quantized`` or ``naive-quantized``: config
  groups of 8-bit ``float`` weights by ``channel`` (``weight_scale`` [N, 1]), ``tensor`` (one
  scale) or ``block`` [128, 128]; input activations none (weight-only), ``dynamic`` per token, or
  static (``input_scale``).

Anything else is refused, naming it. The layers ``linear.quantized_layers`` names are FP8 from the
meta device on wherever they can be (``plan_direct``): a checkpoint's layer whose parts are all stored
e4m3 and read in place gets its codes and row scales written as each part is read (``write_direct``;
the tensor-parallel cuts are the loader's, unchanged), and with ``quantization="fp8"`` every such
layer gets each part quantized per row as it is read. So the device never holds those layers at the
model dtype's 2 bytes a weight: a 70B FP8 checkpoint, or a 70B bf16 one quantized at load, fits one
H200. A layer the loader reorders (Qwen3.5's gated q/k/v) or publishes only partly in FP8 loads as
before: dequantized into the model as read, its codes and scales kept (``keep_codes``) and installed
after the cast to the model's dtype (``install``), or quantized again per channel where its rows
moved. Codes are never re-rounded otherwise. Other FP8 tensors (an LM head, MoE experts) stay
dequantized. Stacked layers with static input scales take their parts' largest (as vLLM does).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prefixserve.config import QUANTIZATIONS
from prefixserve.model import fp8, linear

SUPPORTED = (
    "quant_method 'fp8' (per tensor, or weight_block_size [128, 128]) and 'compressed-tensors' "
    "float-quantized 8-bit float weights by channel, tensor or 128x128 block (and gpt-oss's 'mxfp4' "
    "experts, dequantized)"
)
_SCALE_SUFFIXES = (
    ".weight_scale",
    ".weight_scale_inv",
    ".input_scale",
    ".output_scale",
    ".k_scale",
    ".v_scale",
)


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what} is not supported: prefixserve loads {SUPPORTED}, and quantization='fp8'")


def _block(size: Any, what: str) -> bool:
    if size is None:
        return False
    if list(size) != [fp8.GROUP, fp8.GROUP]:
        raise _refuse(f"{what} {list(size)}")
    return True


def _compressed_tensors(qc: dict[str, Any]) -> tuple[str, bool]:
    """(activation mode, block-scaled) of a compressed-tensors config; refuses what is not FP8."""
    form = qc.get("format")
    if form not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {form!r}")
    schemes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations")
        strategy = w.get("strategy")
        if (
            w.get("type") != "float"
            or w.get("num_bits") != 8
            or strategy not in ("channel", "tensor", "block")
        ):
            raise _refuse(f"compressed-tensors group {name!r} weights {w}")
        block = strategy == "block" and _block(w.get("block_structure"), "compressed-tensors block_structure")
        if a is None:
            act = "none"
        elif a.get("type") == "float" and a.get("num_bits") == 8 and a.get("dynamic") in (True, "local"):
            act = "dynamic"
        elif a.get("type") == "float" and a.get("num_bits") == 8 and a.get("strategy") == "tensor":
            act = "static"
        else:
            raise _refuse(f"compressed-tensors group {name!r} input activations {a}")
        schemes.add((act, block))
    if len(schemes) != 1:
        raise _refuse(f"compressed-tensors config groups {sorted(schemes)} (one FP8 scheme for all)")
    return schemes.pop()


def scheme_of(
    quantization_config: dict[str, Any] | None, quantization: str | None
) -> tuple[str, bool] | None:
    """(activation mode, block-scaled) of a checkpoint's FP8 ``quantization_config``, or of
    ``quantization="fp8"`` on an unquantized one; None: no FP8 weights. Refuses other schemes."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise _refuse(f"quantization {quantization!r}")
    qc = quantization_config
    if qc is None:
        return ("dynamic", False) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: dequantized at load (``model/mxfp4.py``)
        return ("dynamic", False) if quantization == "fp8" else None
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _refuse(f"fp8 fmt {qc.get('fmt')!r}")
        act = qc.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise _refuse(f"fp8 activation_scheme {act!r}")
        return act, _block(qc.get("weight_block_size"), "weight_block_size")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse(f"quantization_config quant_method {method!r}")


class Fp8Checkpoint:
    """One load's FP8 state: the scheme, the checkpoint's scales, and the codes kept per layer."""

    def __init__(self, directory: Path | None, quantization: str | None) -> None:
        qc = None
        if directory is not None and (directory / "config.json").is_file():
            raw = json.loads((directory / "config.json").read_text())
            qc = raw.get("quantization_config") or raw.get("compression_config")
            qc = qc or (raw.get("text_config") or {}).get("quantization_config")
        self.scheme = scheme_of(qc, quantization)
        self.from_checkpoint = (
            qc is not None and qc.get("quant_method") != "mxfp4" and self.scheme is not None
        )
        self.scales: dict[str, torch.Tensor] = {}  # checkpoint name -> its scale tensor
        self.codes: dict[str, torch.Tensor] = {}  # parameter -> codes [N, K]
        self.row_scales: dict[str, torch.Tensor] = {}  # parameter -> scales [N, G]
        self.input_scales: dict[str, torch.Tensor] = {}  # parameter -> the largest static scale
        self.filled: dict[str, int] = {}  # parameter -> rows written
        self.keep: set[str] = set()  # the parameters whose codes are kept
        # parameters a part of which the loader reorders (``Piece.convert``): quantized again
        self.requantize: set[str] = set()
        # weights FP8 from materialization on (``plan_direct``): each piece written as it is read
        self.direct: set[str] = set()

    def read_scales(self, files: list[Path], rename: Callable[[str], str | None]) -> None:
        """Every scale tensor of the checkpoint, read before the weights (any file, any order)."""
        if not self.from_checkpoint:
            return
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    name = rename(stored)
                    if name is not None and name.endswith(_SCALE_SUFFIXES):
                        self.scales[name] = f.get_tensor(stored).float()

    def watch(self, model: nn.Module) -> None:
        """Keep codes for the weights of ``linear.quantized_layers``."""
        self.keep = {f"{name}.weight" for name, _ in linear.quantized_layers(model)}

    def is_scale(self, name: str) -> bool:
        return self.from_checkpoint and name.endswith(_SCALE_SUFFIXES)

    def row_scale(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The scales of checkpoint tensor ``name`` [N, K] as rows: [N, 1] or [N, ceil(K/128)]."""
        base = name.removesuffix(".weight")
        s = self.scales.get(f"{base}.weight_scale_inv", self.scales.get(f"{base}.weight_scale"))
        if s is None:
            raise ValueError(f"FP8 weight {name} has no weight_scale or weight_scale_inv")
        n, k = shape
        blocks = (-(-n // fp8.GROUP), -(-k // fp8.GROUP))
        if s.numel() == 1:
            return s.reshape(1, 1).expand(n, 1)
        if tuple(s.shape) in ((n,), (n, 1)):
            return s.reshape(n, 1)
        if tuple(s.shape) == blocks:
            return s.repeat_interleave(fp8.GROUP, dim=0)[:n]
        raise ValueError(
            f"FP8 weight {name} {list(shape)}: scales {list(s.shape)} are none of [1], [N, 1], {blocks}"
        )

    def source(
        self, name: str, f: Any, stored: str, dense: bool = True
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        """What the loader reads ``stored`` from: (slice or tensor, FP8 codes or None, their row
        scales); an FP8 tensor is dequantized only where ``dense`` (some part of it loads dense)."""
        view = f.get_slice(stored)
        if not view.get_dtype().startswith("F8"):
            return view, None, None
        if view.get_dtype() != "F8_E4M3":
            raise _refuse(f"{stored}: {view.get_dtype()} codes (FP8 weights must be e4m3: F8_E4M3)")
        if self.scheme is None:
            raise _refuse(f"{stored}: an F8_E4M3 tensor without an FP8 quantization_config")
        codes = f.get_tensor(stored)
        scale = self.row_scale(name, tuple(codes.shape))
        return (fp8.dequantize(codes, scale) if dense else codes), codes, scale

    def keep_codes(
        self, param: str, shape: tuple[int, ...], piece: Any, codes: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """The piece's codes and row scales into the parameter's (``piece``: ``loader.Piece``). A piece
        the loader reorders (Qwen3.5's gated q/k/v, Qwen3-Next's regrouped input projection) moves
        rows across its 128-row scale blocks: its parameter's codes are dropped, and the layer is
        quantized again per channel from the dequantized values at ``install``."""
        if param not in self.keep or param in self.requantize:
            return
        if piece.convert is not None:
            self.requantize.add(param)
            for held in (self.codes, self.row_scales, self.filled, self.input_scales):
                held.pop(param, None)
            return
        whole = self.codes.setdefault(param, torch.zeros(shape, dtype=fp8.FP8))
        whole[piece.rows].copy_(_piece_codes(piece, codes))
        part = _scale_part(piece, scale)
        rows = self.row_scales.setdefault(param, torch.empty(shape[0], part.shape[1]))
        if rows.shape[1] != part.shape[1]:
            raise ValueError(
                f"{param}: its parts' FP8 scales differ in kind ({rows.shape[1]} vs {part.shape[1]})"
            )
        rows[piece.rows] = part
        self.filled[param] = self.filled.get(param, 0) + whole[piece.rows].shape[0]
        self._note_input_scale(param, piece)

    def _note_input_scale(self, param: str, piece: Any) -> None:
        """A stacked layer's static input scale: the largest of its parts' (each part's codes hold)."""
        static = self.scales.get(piece.name.removesuffix(".weight") + ".input_scale")
        if static is not None:
            before = self.input_scales.get(param)
            self.input_scales[param] = static if before is None else torch.maximum(before, static)

    def plan_direct(
        self, model: nn.Module, files: list[Path], rename: Callable[[str], str | None], pieces: dict
    ) -> None:
        """Make FP8 on the meta device, before a byte is allocated, the quantized layers whose codes
        can be written as they are read (``write_direct``), so that the device never holds them at
        the model dtype's 2 bytes a weight: with ``quantization="fp8"`` every one (a row's scale needs
        that row alone, so each piece is quantized as read); from an FP8 checkpoint each whose parts
        are all stored e4m3 and read in place (no ``Piece.convert``). The others load as before:
        dense, their codes installed after (``install``). ``pieces``: ``loader._pieces(model)``."""
        if self.scheme is None:
            return
        quantized = {f"{name}.weight": layer for name, layer in linear.quantized_layers(model)}
        if self.from_checkpoint:
            stored = _stored_dtypes(files, rename)
            self.direct = {
                param
                for param in quantized
                if pieces.get(param)
                and all(p.convert is None and stored.get(p.name) == "F8_E4M3" for p in pieces[param])
            }
        else:
            self.direct = set(quantized)
        act, block = self._act(), self.scheme[1]
        for param in self.direct:
            layer = quantized[param]
            n, k = layer.weight.shape
            meta = torch.device("meta")
            static = torch.empty(1, device=meta) if act == "static" else None
            groups = -(-k // fp8.GROUP) if block else 1
            codes = torch.empty(n, k, dtype=fp8.FP8, device=meta)
            fp8.install(layer, codes, torch.empty(n, groups, device=meta), act, static)

    def write_direct(
        self,
        layer: nn.Module,
        param: str,
        piece: Any,
        codes: torch.Tensor | None,
        scale: torch.Tensor | None,
        values: Callable[[], torch.Tensor],
        dtype: torch.dtype,
    ) -> None:
        """A piece of a ``direct`` layer into its FP8 rows and their scales: a checkpoint's codes as
        they are, or (``quantization="fp8"``) ``values()``, the piece's values, rounded to ``dtype``
        as the dense model would hold them and quantized per row on the layer's device."""
        device = layer.weight.device
        with torch.no_grad():
            if codes is None:
                row_codes, row_scales = fp8.quantize_rows(values().to(device, dtype))
            else:
                row_codes, row_scales = _piece_codes(piece, codes), _scale_part(piece, scale)
                self._note_input_scale(param, piece)
            if row_scales.shape[1] != layer.weight_scale.shape[1]:
                raise ValueError(
                    f"{piece.name}: FP8 scales of {row_scales.shape[1]} columns a row where the scheme "
                    f"{self.scheme} has {layer.weight_scale.shape[1]}"
                )
            rows = layer.weight[piece.rows]
            rows.copy_(row_codes)
            layer.weight_scale[piece.rows] = row_scales.to(device)
        self.filled[param] = self.filled.get(param, 0) + rows.shape[0]  # every row once: ``install``

    def _finish_direct(self, param: str, layer: nn.Module, act: str) -> None:
        """Check that a direct layer's every row was read; give it its static input scale."""
        rows, read = layer.weight.shape[0], self.filled.get(param, 0)
        if read != rows:
            raise ValueError(f"{param}: {read} of its {rows} rows were in the checkpoint")
        if act == "static":
            static = self.input_scales.get(param)
            if static is None:
                raise ValueError(f"{param}: static activation quantization needs its input_scale")
            layer.input_scale.copy_(static.reshape(1))

    def _act(self) -> str:
        """The layers' activation mode: block scales run weight-only here (no FP8 tensor-core route
        for them)."""
        assert self.scheme is not None
        return "none" if self.scheme[1] else self.scheme[0]

    def install(self, model: nn.Module) -> int:
        """Give the layers their FP8 weights (after the cast to the model's dtype); returns how many.
        A checkpoint's layers get its codes; ``quantization="fp8"`` quantizes them all."""
        if self.scheme is None:
            return 0
        act, count = self._act(), 0
        for name, layer in linear.quantized_layers(model):
            if f"{name}.weight" in self.direct:  # FP8 since materialization, its codes written as read
                self._finish_direct(f"{name}.weight", layer, act)
                count += 1
        if not self.from_checkpoint:
            return count + linear.quantize_model(model)
        for name, layer in linear.quantized_layers(model):
            param = f"{name}.weight"
            if param in self.direct:
                continue
            # a hybrid's projection with some parts published unquantized (a Qwen3.5 input
            # projection's b and a rows): quantized whole from the loaded values, as a reordered one
            partial = param in self.codes and self.filled[param] != layer.weight.shape[0]
            if param in self.requantize or (partial and isinstance(layer, linear.Projection)):
                fp8.quantize_layer(layer, "dynamic" if act == "static" else act)  # no input scale
                for held in (self.codes, self.row_scales):
                    held.pop(param, None)
                count += 1
                continue
            if param not in self.codes:
                continue  # published unquantized (a compressed-tensors ``ignore``)
            if partial:
                raise ValueError(f"{param}: only some of its stacked parts are FP8 in the checkpoint")
            device = layer.weight.device
            static = self.input_scales.get(param) if act == "static" else None
            fp8.install(
                layer,
                self.codes.pop(param).to(device),
                self.row_scales.pop(param).to(device),
                act,
                None if static is None else static.to(device),
            )
            count += 1
        return count


def _piece_codes(piece: Any, codes: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] a piece (``loader.Piece``) takes: its rows or its shard's columns."""
    index = [slice(None)] * 2
    index[piece.dim] = slice(piece.start, piece.stop)
    return codes[tuple(index)]


def _scale_part(piece: Any, scale: torch.Tensor) -> torch.Tensor:
    """The row scales [rows, G] of a piece (``loader.Piece``) of a weight whose rows' scales are
    ``scale`` [N, G]: its rows' (a stacked part), all rows' (a row-parallel shard's columns under
    per-channel scales), or its 128-column blocks' (block scales; a cut inside a block is refused)."""
    if piece.dim == 0:
        return scale[piece.start : piece.stop]
    if scale.shape[1] == 1:  # a row-parallel shard's columns: the rows' scales as they are
        return scale
    if piece.start % fp8.GROUP:
        raise ValueError(f"{piece.name}: a shard from column {piece.start} cuts its 128-column scale blocks")
    return scale[:, piece.start // fp8.GROUP : -(-piece.stop // fp8.GROUP)]


def _stored_dtypes(files: list[Path], rename: Callable[[str], str | None]) -> dict[str, str]:
    """Each checkpoint tensor's stored dtype ("F8_E4M3", "BF16", ...) by its name in the model (read
    from the files' headers only)."""
    from safetensors import safe_open

    out: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = rename(stored)
                if name is not None:
                    out[name] = f.get_slice(stored).get_dtype()
    return out


__all__ = ["SUPPORTED", "Fp8Checkpoint", "scheme_of"]
