"""Serving on the GPU through the real server path (``benchmarks/serving.py --device cuda``).

RelayAttention's and Hydragen's end-to-end experiments, run against ``python -m prefixserve serve``
started as a subprocess the way a user starts it, loaded by the official ``openai`` client (streaming)
from a few client processes on the same host (``benchmarks/serving_client.py``).

Part ``rate`` (RelayAttention Fig. 5/6): a pinned system prompt of 2K and of 8K tokens, user turns of
64-256 tokens, outputs of 128-512 tokens (EOS ignored, greedy), Poisson arrivals at doubling rates
until the mean normalised latency (end-to-end seconds / generated tokens) passes the SLO (0.1 s/token).
Each rate point gets the same requests and arrival times for every configuration. Configurations:

* ``on``: ``--attention auto``, prefix cache on, both system prompts pinned (``--system-prompt``);
* ``off``: ``--attention triton_paged`` (the plain per-sequence paged kernel; ``reference`` on a CPU)
  and ``--no-prefix-caching``: every request computes its system prompt and attends it alone;
* ``pinned`` (optional): the plain kernel with the prompts pinned (vLLM with the system prompt's KV
  stored once): only the attention differs from ``on``.

Part ``hydragen``: one 16K-token document and 256 questions sent at once; 16 problems after a 2K-token
few-shot prefix, n=64 samples each (the completions API's ``n``); time to all answers and generated
tokens/s with the document's KV stored once (prefix cache on) for ``on`` (``auto``), ``off``
(``triton_paged``) and the no-attention ceiling (``--attention none``), each its own server. Then
the offline ``LLM`` API against the ``on`` server on the same bursts with the same engine settings
(a 256-chat burst with the 8K system prompt, and the document's 256 questions).

``--part report --merge A.json B.json`` writes the report of earlier runs merged (no device needed).
``--smoke`` runs every code path on the CPU with a tiny dummy model and tiny sizes (into a temp dir).
"""

from benchmarks.serving_gpu.cli import main

__all__ = ["main"]
