"""Choose next tokens for a batch of rows, each with its own SamplingParams and random stream.

Filters (temperature, top-k, top-p, min-p) run batched over sorted logits; the draw is an
exponential race (argmax p / E, E ~ Exp(1)), which lets seeded rows use their own generator
without a per-row multinomial call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.sampling.params import SamplingParams


@dataclass(slots=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row (raw model distribution)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, top-k (token, logprob)


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small tensor on ``device`` without a blocking copy (a pageable copy would wait for the GPU)."""
    t = torch.tensor(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p; logits: [R, V] fp32."""
    dev = logits.device
    temp = _to_device([p.temperature for p in params], dev)[:, None]
    scaled = logits / temp
    if any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        rank = torch.arange(vocab, device=dev)[None, :]
        top_k = _to_device([p.top_k or vocab for p in params], dev)[:, None]
        drop = rank >= top_k
        sorted_probs = sorted_logits.softmax(-1)
        top_p = _to_device([p.top_p for p in params], dev)[:, None]
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # keep the token that crosses top_p
        min_p = _to_device([p.min_p for p in params], dev)[:, None]
        drop |= sorted_probs < min_p * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return scaled.softmax(-1)


@dataclass(slots=True)
class SampleFuture:
    """Sampling launched on the device; ``result`` waits for it (lets the host plan the next step first).

    The chosen tokens (and logprobs, when asked) are copied into pinned host memory behind the
    sampling kernels, with an event after the copies, so waiting is one event sync.
    """

    tokens: torch.Tensor  # [R] int64, host
    chosen_lp: torch.Tensor | None  # [R] fp32, host
    top_vals: torch.Tensor | None  # [R, k] fp32, host
    top_ids: torch.Tensor | None  # [R, k] int64, host
    top_counts: list[int]  # top logprobs wanted per row
    event: torch.cuda.Event | None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> SampleResult:
        if self.event is not None:
            self.event.synchronize()
        chosen = self.chosen_lp.tolist() if self.chosen_lp is not None else None
        top: list[list[tuple[int, float]]] | None = None
        if chosen is not None:
            if self.top_vals is not None:
                vals, ids = self.top_vals.tolist(), self.top_ids.tolist()
                top = [list(zip(ids[r][:n], vals[r][:n], strict=True)) for r, n in enumerate(self.top_counts)]
            else:
                top = [[] for _ in self.top_counts]
        return SampleResult(self.tokens.tolist(), chosen, top)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def sample_async(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SampleFuture:
    """Launch the sampling of every row; nothing here waits for the device."""
    dev = logits.device
    rows = logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(greedy) == rows:  # the common all-greedy batch: no index tensors
        tokens = logits.argmax(-1)
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=dev)
        if greedy:
            idx = _to_device(greedy, dev)
            tokens[idx] = logits[idx].argmax(-1)
        idx = _to_device(random_rows, dev)
        probs = _filtered_probs(logits[idx], [params[i] for i in random_rows])
        race = torch.empty_like(probs).exponential_(generator=default_generator)  # one draw for all rows
        for j, i in enumerate(random_rows):
            if generators[i] is not None:  # seeded rows redraw from their own stream
                race[j].exponential_(generator=generators[i])
        tokens[idx] = (probs / race).argmax(-1)
    want = [p.logprobs for p in params if p.logprobs is not None]
    chosen_lp = top_vals = top_ids = None
    counts = [p.logprobs or 0 for p in params]
    if want:
        logp = logits.log_softmax(-1)
        chosen_lp = logp.gather(1, tokens[:, None])[:, 0]
        if max(want) > 0:
            top_vals, top_ids = logp.topk(max(want), dim=-1)
    results = [tokens, chosen_lp, top_vals, top_ids]
    event = None
    if dev.type == "cuda":  # into pinned host memory behind the kernels, then one event to wait on
        results = [None if t is None else _pinned_copy(t) for t in results]
        event = torch.cuda.Event()
        event.record()
    return SampleFuture(*results, counts, event)


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SampleResult:
    """Choose each row's next token (and logprobs when asked); waits for the device."""
    return sample_async(logits, params, generators, default_generator).result()
