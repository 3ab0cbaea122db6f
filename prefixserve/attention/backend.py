"""The interface every attention backend implements, and the registry that picks one by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from prefixserve.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one step's flat batch of query tokens.

    ``prepare`` runs once per step (before the first layer) and may plan work; ``forward`` runs
    once per layer. The new tokens' K/V are already in the cache when ``forward`` is called.
    """

    name: ClassVar[str]
    takes_sinks: ClassVar[bool] = False  # has ``forward_with_lse``: serves models with attention sinks

    def prepare(self, meta: AttentionMetadata) -> None:
        """Plan the step; the default plans nothing and reads every sequence's whole KV."""
        meta.stats["kv_tokens_read"] = float(meta.logical_kv_tokens())
        meta.stats["kv_tokens_logical"] = float(meta.logical_kv_tokens())

    def graph_step(self, meta: AttentionMetadata, shape: Any, bucket: int) -> Any:
        """Plan a decode step for a captured CUDA graph of ``bucket`` rows (``attention/graph.py``).

        Returns a ``GraphStep`` (host-only work), or None when this backend cannot run under a graph;
        ``meta`` then holds host tensors only. The default: no graph support.
        """
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, q_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, q_heads, head_dim], q's dtype
        """The layer's attention output: a new tensor the caller owns (over an e4m3 cache it is scaled
        in place, ``kv_quant.unfold_output``), never a buffer the backend reads again."""

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, q_heads, head_dim] fp32, lse [T, q_heads]
        """``forward`` with each row's log-sum-exp, which attention sinks need
        (``window.attend_with_sinks``); a backend that has it sets ``takes_sinks``."""
        raise NotImplementedError(f"the {self.name!r} backend does not return the attention's LSE")


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a backend selectable by its ``name``."""
    _REGISTRY[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    _load_builtin_backends()
    return sorted(_REGISTRY)


def make_backend(name: str) -> AttentionBackend:
    """Instantiate the backend called ``name``; raises ValueError listing the known names."""
    _load_builtin_backends()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def backend_for_model(name: str, sinks: bool) -> AttentionBackend:
    """The backend ``name`` for a model; one without attention sinks (``forward_with_lse``) is refused
    by name for a model that has them (gpt-oss)."""
    backend = make_backend(name)
    if sinks and not backend.takes_sinks:
        takes = sorted(n for n, cls in _REGISTRY.items() if cls.takes_sinks)
        raise ValueError(
            f"attention={name!r} does not take attention sinks (gpt-oss); backends that do: {takes}"
        )
    return backend


def _load_builtin_backends() -> None:
    # Importing a backend module registers it; optional ones may be missing (e.g. no Triton).
    import importlib

    for module in ("reference", "cascade", "auto", "no_attention", "triton_backend"):
        try:
            importlib.import_module(f"prefixserve.attention.{module}")
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("prefixserve.attention"):
                raise
