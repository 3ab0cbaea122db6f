"""prefixserve: an LLM inference engine for workloads whose requests share context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixserve.version import __version__

__all__ = [
    "LLM",
    "BeamSearchParams",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputs",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:
    from prefixserve.config import EngineConfig
    from prefixserve.entrypoints.llm import LLM
    from prefixserve.outputs import EmbeddingRequestOutput, Logprob, RequestOutput, ScoringRequestOutput
    from prefixserve.pooling_params import PoolingParams
    from prefixserve.sampling.beam_search import BeamSearchParams
    from prefixserve.sampling.params import SamplingParams
    from prefixserve.sampling.structured_outputs import StructuredOutputs, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import prefixserve` stays cheap (the CLI's --help, the server's workers).
    if name == "LLM":
        from prefixserve.entrypoints.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from prefixserve.sampling.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "SamplingParams":
        from prefixserve.sampling.params import SamplingParams

        return SamplingParams
    if name in ("StructuredOutputs", "StructuredOutputsParams"):
        from prefixserve.sampling import structured_outputs

        return getattr(structured_outputs, name)
    if name == "EngineConfig":
        from prefixserve.config import EngineConfig

        return EngineConfig
    if name in ("RequestOutput", "EmbeddingRequestOutput", "ScoringRequestOutput", "Logprob"):
        from prefixserve import outputs

        return getattr(outputs, name)
    if name == "PoolingParams":
        from prefixserve.pooling_params import PoolingParams

        return PoolingParams
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
