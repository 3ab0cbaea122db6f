"""The engine: the loop (``llm_engine``) apart from the model runner (``model_runner``).

llm_engine        Engine: wiring, requests in, outputs out; schedule -> assemble -> launch -> update
input_processor   request intake and validation: a caller's prompt to a checked Request
step_inputs       a scheduled step's positions, lengths, block tables and token ids for the runner
in_flight         launch-ahead bookkeeping: placeholders for sampled tokens still on the device
stats             counters, step timers, gauges and metrics()
model_runner      ModelRunner: KV cache, attention backend, CUDA graphs, forward, sampling on the device
cuda_graph        decode steps captured and replayed as CUDA graphs (the runner's)
argmax_graph      under tensor parallelism, a graphed step's sharded argmax replayed from its own graph
graph_capture     one CUDA graph capture into a shared pool, its pool routing ended should it fail
output_processor  texts and RequestOutput (stop checks are the scheduler's: scheduler/stop.py)
system_prompts    applications' system prompts, their KV held (RelayAttention)
gc_tuning         Python GC thresholds for an engine process
"""

from prefixserve.engine.llm_engine import PLACEHOLDER_TOKEN, Engine
from prefixserve.engine.system_prompts import SystemPromptKV

__all__ = ["PLACEHOLDER_TOKEN", "Engine", "SystemPromptKV"]
