"""Run by ``test_tensor_parallel_gpu.py`` in a process of its own (only a process's first
tensor-parallel engine takes the peer kernels): kill worker 1 while rank 0 decodes over the peer
kernels, then report whether the generation failed and whether rank 0's GPU drained.

    python tests/tp_dead_peer.py CONFIG_JSON   (prints one line: "<error class> <DRAINED|STUCK>")
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from prefixserve import LLM, SamplingParams


def main(config_path: str) -> None:
    llm = LLM(model=f"dummy:{config_path}", tensor_parallel_size=2, num_kv_blocks=512, progress=False)
    runner = llm.engine.runner
    assert runner.shard.peer is not None and runner.shard.peer.fused is not None, "no peer kernels"
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # graphs in
    worker = runner.procs[0]

    def kill() -> None:
        time.sleep(0.5)
        os.kill(worker.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts, params)
        error = "none"  # decode ended before the kill: the caller retries or fails
    except Exception as exc:  # the class is the report
        error = type(exc).__name__
    drained = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), drained.set()), daemon=True).start()
    print(error, "DRAINED" if drained.wait(20) else "STUCK", flush=True)
    os._exit(0)  # a GPU still spinning must not hold the interpreter's exit


if __name__ == "__main__":
    main(sys.argv[1])
