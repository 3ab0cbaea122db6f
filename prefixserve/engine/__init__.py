"""The engine: the loop (``llm_engine``) apart from the model runner (``model_runner``).

llm_engine        Engine: requests in, outputs out; schedule -> plan -> launch -> update -> outputs
model_runner      ModelRunner: KV cache, attention backend, CUDA graphs, forward, sampling on the device
cuda_graph        decode steps captured and replayed as CUDA graphs (the runner's)
output_processor  stop checks, stop strings, texts, RequestOutput
pinned            pinned system prompts (RelayAttention)
"""

from prefixserve.engine.llm_engine import PLACEHOLDER_TOKEN, Engine
from prefixserve.engine.pinned import PinnedPrompt

__all__ = ["PLACEHOLDER_TOKEN", "Engine", "PinnedPrompt"]
