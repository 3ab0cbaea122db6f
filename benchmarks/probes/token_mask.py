"""Probe: a constrained greedy sampling's host and device time with the grammar's mask applied by
torch ops or by the token-mask kernel (``sampling/token_mask.py``), beside the sampling alone.

B rows of hidden states go through an LM head of V entries, the mask (random words in a pinned
``StepBitmasks`` slot, as the matcher process leaves it) is copied and applied, and the argmax is
issued with its copy to the host (``sample_async``). Each form is timed for its host time (issue only,
the device idle before each call) and for issue plus the wait for the device. Both forms are checked
against ``apply_bitmask_reference`` first.

    PYTHONPATH=. python -m benchmarks.probes.token_mask [--batch 64] [--shapes 49152x576 128256x4096]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def _median_us(fn: Callable[[], None], wait: bool, n: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        if wait:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


def _measure(vocab: int, hidden: int, b: int) -> None:
    """Check both forms, then print the three samplings' times at one vocabulary."""
    from prefixserve import SamplingParams
    from prefixserve.sampling.sampler import sample_async
    from prefixserve.sampling.token_mask import blocked_tokens, kernel_token_mask
    from prefixserve.structured.bitmask import StepBitmasks, apply_bitmask_reference

    params, generators = [SamplingParams(temperature=0.0)] * b, [None] * b
    words = -(-vocab // 32)
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16)
    masks = StepBitmasks(words, "cuda", b)
    host = masks.host(b)
    host.copy_(torch.randint(-(2**31), 2**31 - 1, (b, words), dtype=torch.int32))
    dev = torch.empty(b, words, dtype=torch.int32, device="cuda")

    def torch_ops(logits: torch.Tensor) -> None:
        dev.copy_(host, non_blocking=True)
        logits.masked_fill_(blocked_tokens(dev, vocab), float("-inf"))

    def kernel(logits: torch.Tensor) -> None:
        dev.copy_(host, non_blocking=True)
        kernel_token_mask(logits, dev, None)

    want = torch.randn(b, vocab)
    ref = want.clone()
    apply_bitmask_reference(ref, host, list(range(b)))
    for form in (torch_ops, kernel):
        got = want.cuda()
        form(got)
        assert torch.equal(got.cpu(), ref), form.__name__

    def step(form: Callable[[torch.Tensor], None] | None) -> Callable[[], None]:
        def run() -> None:
            logits = x @ weight.T
            if form is not None:
                form(logits)
            sample_async(logits, params, generators)

        return run

    print(f"V={vocab:,}, hidden {hidden}")
    for name, fn in (("LM head + argmax", step(None)), ("+ mask, torch ops", step(torch_ops)),
                     ("+ mask, kernel", step(kernel))):  # fmt: skip
        print(f"  {name:20s} {_median_us(fn, False):8.1f} {_median_us(fn, True):8.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shapes", nargs="+", default=["49152x576", "128256x4096"], help="VOCABxHIDDEN")
    args = ap.parse_args(argv)
    print(
        f"B={args.batch}, {torch.cuda.get_device_name()}: host us (issue) / us with the wait for the device"
    )
    for shape in args.shapes:
        vocab, hidden = map(int, shape.split("x"))
        _measure(vocab, hidden, args.batch)


if __name__ == "__main__":
    main()
