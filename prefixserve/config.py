"""Engine settings, validated once at construction (a bad value names itself in the error), and the
environment switches: the only place where the package reads a ``PREFIXSERVE_*`` variable.

The switches are read when called (not at import), so a test or a benchmark that sets the variable
sees its effect on the next call; a bad value raises ValueError naming the variable.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# the KV cache's element type (vLLM's --kv-cache-dtype): auto, the model's dtype; fp8 (= fp8_e4m3), e4m3
# with a scale per layer and KV head (attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; one rule reads both (reasoning.py)


def _template_text(given: str) -> str:
    """``--chat-template``: a file's text, or the template as given (it holds a Jinja tag)."""
    if "{" in given:
        return given
    path = Path(given).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {given!r} is neither a file nor a Jinja template")
    return path.read_text(encoding="utf-8")


SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)


CACHE_SALT_SCOPES = ("prompt", "after-system")  # what a cache_salt covers (docs/guides/tenants.md)
POLICIES = ("fcfs", "priority", "fair")  # scheduling policies (scheduler/policy.py)
QUANTIZATIONS = ("fp8",)  # weight quantizations at load (model/fp8.py)


def check_weights(weights: dict[str, float]) -> dict[str, float]:
    """ValueError naming the tenant for a weight that is not a positive finite number (the ``fair``
    policy's ``tenant_weights``)."""
    out: dict[str, float] = {}
    for name, w in weights.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tenant weight needs a tenant name, got {name!r}")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"tenant {name!r}: weight must be a positive number, got {w!r}")
        out[name] = float(w)
    return out


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's ``{"method": "ngram", ...}``): the last
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens of a sequence are looked up earlier in
    its own tokens, and the ``num_speculative_tokens`` that followed there are proposed as drafts,
    all checked by one forward (``engine/speculative.py``). ``disable_by_batch_size``: no drafts in a
    step while more sequences than this run (None: always)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    method: str = "ngram"
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown keys {unknown} (known: {', '.join(SPECULATIVE_KEYS)})"
            )
        if spec.get("method", "ngram") != "ngram":
            raise ValueError(f"speculative_config: method {spec.get('method')!r} is not supported (ngram is)")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens")
        for name in SPECULATIVE_KEYS[1:]:
            value = spec.get(name, 1)
            if name == "disable_by_batch_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        low = spec.get("prompt_lookup_min", 1)
        top = spec.get("prompt_lookup_max", max(4, low))
        made = cls(
            spec["num_speculative_tokens"], top, low, disable_by_batch_size=spec.get("disable_by_batch_size")
        )
        if made.prompt_lookup_min > made.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max")
        return made


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    # the names the model is served under (vLLM's --served-model-name): the first is the one answers
    # carry; requests may name any of them (or "default"). Empty: the model's own name
    served_model_name: tuple[str, ...] = ()
    # the chat template every chat is rendered with, in place of the tokenizer's (vLLM's
    # --chat-template): a file's path, or the template itself; held as the template's text
    chat_template: str | None = None
    # a thinking model's <think> ... </think> answered apart as reasoning_content (vLLM's
    # --reasoning-parser; protocols/openai/reasoning.py); None: the output as it is
    reasoning_parser: str | None = None
    # a chat request's own chat_template renders it (vLLM's --trust-request-chat-template); off: a
    # request that sends one is refused, as a template runs code-like logic chosen by the client
    trust_request_chat_template: bool = False
    # what a request's cache_salt covers, where the request names no scope (--cache-salt-scope):
    # "prompt" (vLLM's: the whole prompt) or "after-system" (the system messages, a registered
    # application prompt are public: their blocks shared across salts; docs/guides/tenants.md)
    cache_salt_scope: str = "prompt"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # "fp8": the attention and MLP projections' weights quantized to FP8 at load (per output channel;
    # model/fp8.py). None: as the checkpoint has them (an FP8 checkpoint loads as FP8 either way)
    quantization: str | None = None
    device: str = "auto"  # auto: cuda if available, else cpu
    kv_cache_dtype: str = "auto"  # auto: the model's dtype | fp8 (fp8_e4m3): half the bytes a token
    attention: str = "auto"  # auto | reference | cascade | triton | triton_paged | none (benchmarks only)
    block_size: int = 16
    # None: what max_num_seqs sequences of max_model_len tokens hold, capped by kv_memory_fraction
    # (model/memory_fit.py); more blocks keep more of the prefix cache
    num_kv_blocks: int | None = None
    kv_memory_fraction: float | None = None  # None: 0.85 of free GPU memory, 0.1 of RAM on a CPU
    # vLLM's --gpu-memory-utilization: the share of the GPU's whole memory this engine may use, weights,
    # steps and KV pool together (what other processes hold counts against it); in place of
    # kv_memory_fraction. On a CPU: the share of RAM the KV pool may take
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 256
    # offline batches (BatchLLM memory-centric batching): group members are admitted while the KV pool
    # stays under this share of its blocks; online requests are admitted while blocks last
    kv_admit_threshold: float = 0.9
    # the share of the KV pool that cache breakpoints (Anthropic's cache_control TTLs) may keep pinned
    cache_control_fraction: float = 0.25
    # the waiting queue's order: "fcfs" (arrival), or "priority" (a request's priority, then arrival;
    # the least urgent running request is the one preempted); requests may set a priority only then
    scheduling_policy: str = "fcfs"
    # under ``fair``: each tenant's share of the engine relative to the others' (default 1)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    max_model_len: int | None = None  # None: the model's context length (capped by the pool)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps are captured and replayed on CUDA)
    # plan step N+1 on the host while the GPU runs step N (outputs come one step() later); None: on
    # exactly when CUDA graphs are
    async_scheduling: bool | None = None
    seed: int = 0  # dummy weights and unseeded sampling
    # speculative decoding (vLLM's speculative_config): {"method": "ngram", "num_speculative_tokens":
    # K, "prompt_lookup_max": 4, "prompt_lookup_min": 1}; None: off. Steps then wait for their tokens
    # (no launch-ahead): the next step's drafts are read from them
    speculative_config: dict[str, Any] | None = None
    # default sampling parameters of requests that leave them unset (vLLM's --generation-config):
    # "auto" reads generation_config.json from the model's folder, "vllm" reads none (OpenAI's
    # defaults), else a folder to read it from; the override's keys win (entrypoints/generation_config.py)
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # a streamed request reports progress every this many generated tokens (per sample; the final
    # output always comes): fewer, larger chunks for a server whose HTTP loop cannot keep up
    stream_interval: int = 1
    system_prompts: dict[str, str] = field(default_factory=dict)  # application -> pinned prompt
    # Prompt Cache: PML schemas registered at start-up; encoded module KV may take this share of the
    # KV pool, then moves to host memory (this many bytes), then off the end; with module_store,
    # every encoded module is also kept on disk there (checksummed)
    schemas: list[str] = field(default_factory=list)
    module_gpu_fraction: float = 0.5
    module_host_bytes: int = 4 << 30
    module_store: str | None = None
    # Prompt Cache accuracy recovery for PML requests that do not set their own (schemas may set
    # one): "none", "link:K" (recompute each module's first K tokens in context) or "blend:R"
    # (recompute a fraction R, chosen by KV deviation); checked by promptcache/recompute.py.
    # link:64 is the cheapest setting measured to close >= 90% of the KL gap to full prefill
    # (docs/benchmarks/promptcache_cpu.md); "none" is Prompt Cache as the paper has it
    module_recompute: str = "link:64"
    # prefix-cache blocks evicted from the pool are copied to that host tier and come back on a hit
    spill_prefix_cache: bool = False
    # models mixing sliding-window and full layers: True keeps every layer's KV of every block; by
    # default the sliding layers' pages of blocks behind every holder's window go back to the pool
    # (kv/layout.py), except where schemas, the host tier or tensor parallelism need every layer's
    keep_sliding_kv: bool = False
    # tensor parallelism: the model split over this many GPUs (gloo processes on a CPU), one worker
    # process per rank beside this one (prefixserve/worker/tp_runner.py)
    tensor_parallel_size: int = 1
    # tensor parallelism on GPUs: decode-sized all-reduces through PyTorch's symmetric memory (NVLink
    # peer reads; model/peer_allreduce.py), NCCL above its buffer's size or where peer memory is
    # unavailable (docs/benchmarks/tensor_parallel_allreduce/ measures the two)
    tp_peer_allreduce: bool = True

    @property
    def frees_sliding_kv(self) -> bool:
        """Whether sliding layers may give their blocks back: not with ``keep_sliding_kv``, schemas
        (Prompt Cache modules), the host tier or tensor parallelism, which keep every layer's KV."""
        return not (
            self.keep_sliding_kv or self.schemas or self.spill_prefix_cache or self.tensor_parallel_size > 1
        )

    def __post_init__(self) -> None:
        self.served_model_name = tuple(self.served_model_name)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {known}, got {self.reasoning_parser!r}")
        if self.cache_salt_scope not in CACHE_SALT_SCOPES:
            known = ", ".join(CACHE_SALT_SCOPES)
            raise ValueError(f"cache_salt_scope must be one of {known}, got {self.cache_salt_scope!r}")
        if self.chat_template is not None:
            self.chat_template = _template_text(self.chat_template)
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_name):
            raise ValueError(f"served_model_name takes non-empty names, got {self.served_model_name!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            known = ", ".join(QUANTIZATIONS)
            raise ValueError(f"quantization must be one of {known} (or unset), got {self.quantization!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            known = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {known}, got {self.kv_cache_dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device {self.device!r} must be auto, cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but no CUDA GPU is available")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                got = self.gpu_memory_utilization
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {got}")
            if self.kv_memory_fraction is not None:
                raise ValueError("set gpu_memory_utilization or kv_memory_fraction, not both")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, dict):
                raise ValueError("speculative_config must be a dict (method, num_speculative_tokens, ...)")
            SpeculativeConfig.from_dict(self.speculative_config)
            if self.async_scheduling:
                raise ValueError(
                    "speculative_config needs async_scheduling off (the drafts read each step's tokens)"
                )
        if not isinstance(self.override_generation_config, dict):
            raise ValueError("override_generation_config must be a dict of sampling defaults")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0.0 <= self.cache_control_fraction <= 1.0:
            raise ValueError(f"cache_control_fraction must be in [0, 1], got {self.cache_control_fraction}")
        if not 0.0 < self.kv_admit_threshold <= 1.0:
            raise ValueError(f"kv_admit_threshold must be in (0, 1], got {self.kv_admit_threshold}")
        if self.scheduling_policy not in POLICIES:
            known = ", ".join(POLICIES)
            raise ValueError(f"scheduling_policy must be one of {known}, got {self.scheduling_policy!r}")
        self.tenant_weights = check_weights(self.tenant_weights)
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not 0.0 < self.module_gpu_fraction <= 1.0:
            raise ValueError(f"module_gpu_fraction must be in (0, 1], got {self.module_gpu_fraction}")
        if self.module_host_bytes < 0:
            raise ValueError(f"module_host_bytes must be >= 0, got {self.module_host_bytes}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available()):
            first = torch.device(self.device if self.device != "auto" else "cuda").index or 0
            if first + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} from cuda:{first} needs more GPUs "
                    f"than the {torch.cuda.device_count()} visible"
                )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's element type: the model's, or e4m3 with ``kv_cache_dtype`` fp8."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return (
            None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        )

    @property
    def memory_fraction(self) -> float:
        if self.kv_memory_fraction is not None:
            return self.kv_memory_fraction
        if self.gpu_memory_utilization is not None and self.torch_device.type != "cuda":
            return self.gpu_memory_utilization
        return 0.85 if self.torch_device.type == "cuda" else 0.1


# --- environment switches ----------------------------------------------------------------------------
# tests/test_env_switches.py fails if any other module of the package names a PREFIXSERVE_* variable


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def cache_dir() -> Path:
    """``PREFIXSERVE_CACHE``: the directory for converted models (a GGUF dequantized once into an HF
    directory). Any directory path; default ``~/.cache/prefixserve``."""
    value = os.environ.get("PREFIXSERVE_CACHE")
    if value is None:
        return Path.home() / ".cache" / "prefixserve"
    if not value.strip():
        raise ValueError("PREFIXSERVE_CACHE is set but empty: give a directory, or unset it")
    return Path(value)


@contextlib.contextmanager
def cache_entry(out: Path) -> Iterator[Path]:
    """A folder to build ``out`` in: made beside it, renamed to it when the block ends (dropped if
    another process finished ``out`` first), removed if the block fails. A reader that finds ``out``
    finds it whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        yield tmp
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def mixed_mode() -> str:
    """``PREFIXSERVE_MIXED``: whether a decode step runs its shared and own tiles as one mixed launch
    (mixed_gluon.py). "auto" (default): where ``mixed_rule.use_mixed`` predicts a gain; "1": every
    eligible decode step; "0": never (shared kernel + own kernel). An explicit ``TritonBackend.mixed``
    overrides it."""
    return _env_choice("PREFIXSERVE_MIXED", "auto", ("auto", "0", "1"))
