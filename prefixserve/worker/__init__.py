"""The device worker: the model runner (the KV cache, the attention backend, a step's launch and its
sampled tokens), its CUDA graphs (whole decode steps, the dense pieces between attentions, the
sharded argmax), the CPU's memory settings, and tensor parallelism's rank-0 runner and worker
processes. The engine (``prefixserve/engine``) drives it; it knows nothing of requests."""
