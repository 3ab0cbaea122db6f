"""Command-line engine and sampling options, shared by ``cli`` and ``server`` (cli imports server, not back).

``add_engine_args`` puts the engine options on an argparse parser; ``engine_config_from_args`` turns
the parsed options into an ``EngineConfig``. Only the standard library is imported at module level.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefixserve.config import CACHE_SALT_SCOPES, KV_CACHE_DTYPES, POLICIES, QUANTIZATIONS

__all__ = [
    "add_engine_args",
    "add_sampling_args",
    "engine_config_from_args",
    "parse_bytes",
    "read_schemas",
    "read_system_prompts",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF model directory, or dummy:CONFIG (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's element type: auto (the model's dtype) or fp8 (= fp8_e4m3: e4m3 with a "
        "scale per layer and KV head: a byte an element, so the pool holds twice the tokens of a bf16 "
        "cache, four times an fp32 one's)",
    )
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: the attention and MLP weights quantized to FP8 at load (per output channel); an FP8 "
        "checkpoint loads as FP8 without it",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--attention", default="auto", help="auto | reference | cascade | triton | triton_paged")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (default: enough for --max-num-seqs sequences of the model's "
        "context; on a GPU also no more than --kv-memory-fraction of its free memory). More blocks "
        "keep more of the prefix cache",
    )
    g.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        metavar="F",
        help="the most of the memory the default KV pool may take: of free GPU memory (default 0.85), "
        "of RAM on a CPU (default 0.1)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="vLLM's: the share of the GPU's whole memory the engine may use, weights, steps and KV "
        "pool together (memory other processes hold counts against it); in place of --kv-memory-fraction",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="sequences running at once (default 256; generate and chat: the sequences they run)",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="render chats with this Jinja template (a file, or the template itself) instead of the model's",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        default=None,
        help="answer a thinking model's <think> ... </think> apart, as reasoning_content (chats)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat with the chat_template its request sends (refused with a 400 otherwise)",
    )
    g.add_argument(
        "--cache-salt-scope",
        choices=CACHE_SALT_SCOPES,
        default="prompt",
        help="what a request's cache_salt covers where it names no scope: the whole prompt (vLLM's), or "
        "all but the system messages and application prompt, whose blocks tenants then share",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names the model is served under: answers carry the first, requests may name any",
    )
    g.add_argument(
        "--scheduling-policy",
        choices=POLICIES,
        default="fcfs",
        help="the waiting queue's order: fcfs (arrival), priority (a request's priority field, "
        "smaller first, then arrival), or fair (tenants' virtual token counters; a tenant is the "
        "request's user)",
    )
    g.add_argument(
        "--cache-control-fraction",
        type=float,
        default=0.25,
        help="the share of the KV pool that Anthropic cache_control breakpoints may keep pinned for "
        "their TTLs; a request past it is answered, its breakpoints not honoured (a header says so)",
    )
    g.add_argument(
        "--tenant-weight",
        action="append",
        default=[],
        metavar="TENANT=WEIGHT",
        help="under --scheduling-policy fair: a tenant's share relative to the others' (default 1); "
        "repeat for each tenant",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the automatic prefix cache off")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's names: the prefix cache is on unless --no-enable-prefix-caching (= --no-prefix-caching)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="default sampling parameters for requests that leave them unset, as vLLM's: auto reads "
        "generation_config.json in the model's folder, vllm none (OpenAI's defaults), DIR that folder's",
    )
    g.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="sampling defaults merged over the generation config, e.g. '{\"temperature\": 0.6}' (keys: "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='speculative decoding by prompt lookup, as vLLM\'s: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (drafts from the sequence\'s own tokens)',
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; prefixserve never runs code that comes with a model",
    )
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="streamed requests get an output every N generated tokens (the last always)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many GPUs (gloo processes on a CPU)",
    )
    g.add_argument(
        "--tp-peer-allreduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tensor parallelism: decode-sized all-reduces over NVLink peer memory (symmetric memory) "
        "instead of NCCL (on by default; --no-tp-peer-allreduce: NCCL for all)",
    )
    g.add_argument(
        "--disable-custom-all-reduce",
        dest="tp_peer_allreduce",
        action="store_false",
        help="vLLM's name for --no-tp-peer-allreduce",
    )
    g.add_argument(
        "--system-prompt",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="pin an application's system prompt (computed once at start-up, never evicted)",
    )
    m = p.add_argument_group("prompt cache (PML schemas of reusable prompt modules)")
    m.add_argument(
        "--schema",
        action="append",
        default=[],
        metavar="FILE",
        help="register the PML <schema> in FILE at start-up, its modules encoded then (repeatable)",
    )
    m.add_argument(
        "--module-store",
        default=None,
        metavar="DIR",
        help="also keep every encoded module on disk here (checksummed; reused across restarts)",
    )
    m.add_argument(
        "--module-gpu-fraction",
        type=float,
        default=None,
        metavar="F",
        help="share of the KV pool encoded modules may hold before moving to host memory (default 0.5)",
    )
    m.add_argument(
        "--module-host-bytes",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="host memory for modules moved off the GPU, e.g. 4G or 512M (default 4G)",
    )
    m.add_argument(
        "--module-recompute",
        default=None,
        metavar="MODE",
        help="accuracy recovery for PML prompts that set none themselves: none (Prompt Cache as is), "
        "link:K (recompute each module's first K tokens in context) or blend:R (recompute a fraction R "
        "of each module, where its cached KV differs most) (default link:64)",
    )
    m.add_argument(
        "--spill-prefix-cache",
        action="store_true",
        help="copy prefix-cache blocks evicted from the KV pool to that host memory; a later hit "
        "copies them back instead of recomputing",
    )
    m.add_argument(
        "--keep-sliding-kv",
        action="store_true",
        help="models with sliding-window layers: keep every layer's KV of every block (by default the "
        "sliding layers' KV behind every sequence's window goes back to the pool); needed for PML "
        "schemas registered after start-up",
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's KV)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], over the output tokens")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], over the output tokens")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="(0, 2], over prompt and output (1 = off)"
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=None,
        metavar="ID=BIAS",
        help="add BIAS in [-100, 100] to token ID's logit (repeatable)",
    )


def read_system_prompts(items: list[str]) -> dict[str, str]:
    """``--system-prompt NAME=FILE`` items as {name: file text}."""
    out = {}
    for item in items:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            raise ValueError(f"--system-prompt wants NAME=FILE, got {item!r}")
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"system prompt file {file!r} not found")
        out[name] = path.read_text()
    return out


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``4294967296``, ``4G``, ``4GiB``, ``512M``, ``512MB`` (powers of 1024) -> bytes."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (raw[:-1], raw[-1]) if raw[-1:] in _UNITS else (raw, "")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4G, 512M, 1048576)") from None
    if not 0 <= value < 1 << 62:  # also NaN and inf
        raise argparse.ArgumentTypeError(f"a size in bytes must be in [0, 2**62), got {text!r}")
    return int(value)


def read_schemas(files: list[str]) -> list[str]:
    """``--schema FILE`` items as the files' PML texts (parsed when the engine registers them)."""
    out = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"schema file {file!r} not found")
        out.append(path.read_text(encoding="utf-8"))
    return out


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"wants a JSON object, got {text!r}")
    return value


def _model(args: argparse.Namespace) -> str | None:
    """``--model``, or the model named first as vLLM's ``serve MODEL`` does (the two must agree)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"two models given: {tag!r} and --model {args.model!r}")
    return tag if tag is not None else args.model


def _prefix_caching(args: argparse.Namespace) -> bool:
    if args.no_prefix_caching and args.enable_prefix_caching:
        raise ValueError("--no-prefix-caching and --enable-prefix-caching contradict each other")
    return not args.no_prefix_caching and args.enable_prefix_caching is not False


def _tenant_weights(given: list[str]) -> dict[str, float]:
    """``--tenant-weight NAME=W`` options as a dict (EngineConfig checks the numbers)."""
    out: dict[str, float] = {}
    for item in given:
        name, sep, weight = item.rpartition("=")
        try:
            out[name] = float(weight) if sep and name else float("nan")
        except ValueError:
            out[name] = float("nan")
        if not sep or not name or out[name] != out[name]:
            raise ValueError(f"--tenant-weight takes TENANT=WEIGHT (a positive number), got {item!r}")
    return out


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """The EngineConfig the engine options on the command line describe (validated by EngineConfig)."""
    from prefixserve.config import EngineConfig

    given: dict[str, Any] = {}  # left out when not given: EngineConfig's defaults hold
    if getattr(args, "engine_seed", None) is not None:
        given["seed"] = args.engine_seed
    if args.speculative_config is not None:
        given["speculative_config"] = args.speculative_config
    if args.override_generation_config is not None:
        given["override_generation_config"] = args.override_generation_config
    if args.module_gpu_fraction is not None:
        given["module_gpu_fraction"] = args.module_gpu_fraction
    if args.module_host_bytes is not None:
        given["module_host_bytes"] = args.module_host_bytes
    if args.module_recompute is not None:
        given["module_recompute"] = args.module_recompute
    if args.max_num_seqs is not None:
        given["max_num_seqs"] = args.max_num_seqs
    return EngineConfig(
        model=_model(args),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        attention=args.attention,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_memory_fraction=args.kv_memory_fraction,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        tenant_weights=_tenant_weights(args.tenant_weight),
        cache_control_fraction=args.cache_control_fraction,
        served_model_name=tuple(args.served_model_name or ()),
        chat_template=args.chat_template,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        cache_salt_scope=args.cache_salt_scope,
        max_model_len=args.max_model_len,
        enable_prefix_caching=_prefix_caching(args),
        generation_config=args.generation_config,
        enforce_eager=args.enforce_eager,
        stream_interval=args.stream_interval,
        system_prompts=read_system_prompts(args.system_prompt),
        schemas=read_schemas(args.schema),
        module_store=args.module_store,
        spill_prefix_cache=args.spill_prefix_cache,
        keep_sliding_kv=args.keep_sliding_kv,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_peer_allreduce=args.tp_peer_allreduce,
        **given,
    )


def parse_logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """``--logit-bias ID=BIAS`` items as {token id: bias}; a malformed item raises ValueError naming it."""
    if not items:
        return None
    out = {}
    for item in items:
        tid, sep, bias = item.partition("=")
        try:
            out[int(tid)] = float(bias)
        except ValueError:
            raise ValueError(f"logit_bias: --logit-bias wants ID=BIAS, got {item!r}") from None
        if not sep:
            raise ValueError(f"logit_bias: --logit-bias wants ID=BIAS, got {item!r}")
    return out
