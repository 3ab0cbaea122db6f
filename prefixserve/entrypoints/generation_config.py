"""Default sampling parameters from the model's ``generation_config.json``, as vLLM's
``--generation-config`` / ``--override-generation-config`` give them.

A model's authors often recommend how to sample it (Qwen3: temperature 0.6, top_p 0.95, top_k 20).
vLLM reads those recommendations from the model's folder by default and uses them wherever a request
(or ``LLM.generate`` without ``SamplingParams``) leaves a parameter unset; a request's own values
always win. Users coming from vLLM expect the same answers here, so the same keys are read the same
way: ``auto`` reads the model's folder (an HF directory, the folder of a ``.gguf`` file or of a dummy
config, where a ``generation_config.json`` lies beside it), ``vllm`` reads nothing (the OpenAI
defaults), any other value names a folder to read. The override's keys are merged over what was read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from prefixserve.config import EngineConfig
from prefixserve.model.loader import resolve_model
from prefixserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json's keys that set sampling defaults (vLLM's list) -> SamplingParams' fields
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _folder(config: EngineConfig) -> Path:
    """Where ``generation_config="auto"`` looks: the model's folder."""
    source = resolve_model(config.model)
    return source.path if source.path.is_dir() else source.path.parent


def _read(folder: Path, required: bool) -> dict[str, Any]:
    path = folder / FILE
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"generation_config: {folder} has no {FILE}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return {key: data[key] for key in SAMPLING_KEYS if data.get(key) is not None}


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The SamplingParams fields a request that leaves them unset takes ({} : OpenAI's defaults).

    Checked once, at start-up: an override with an unknown key or a value SamplingParams refuses
    fails here, naming it, not at the first request."""
    override = dict(config.override_generation_config)
    unknown = sorted(set(override) - set(SAMPLING_KEYS))
    if unknown:
        known = ", ".join(SAMPLING_KEYS)
        raise ValueError(f"override_generation_config: unknown keys {unknown} (known: {known})")
    mode = config.generation_config
    if mode == "vllm":
        read: dict[str, Any] = {}
    elif mode == "auto":
        read = _read(_folder(config), required=False)
    else:
        read = _read(Path(mode).expanduser(), required=True)
    merged = {SAMPLING_KEYS[k]: v for k, v in {**read, **override}.items()}
    try:
        SamplingParams(**merged)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the generation config's sampling defaults {merged} are invalid: {exc}") from None
    if read:
        log.info(
            "sampling defaults from the model's %s: %s (requests that set a value keep theirs; "
            "--generation-config vllm ignores the file)",
            FILE,
            merged,
        )
    return merged


__all__ = ["FILE", "SAMPLING_KEYS", "sampling_defaults"]
