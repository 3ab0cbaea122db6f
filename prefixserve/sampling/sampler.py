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


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p; logits: [R, V] fp32."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    scaled = logits / temp
    if any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        rank = torch.arange(vocab, device=dev)[None, :]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)[:, None]
        drop = rank >= top_k
        sorted_probs = sorted_logits.softmax(-1)
        top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p  # keep the token that crosses top_p
        min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
        drop |= sorted_probs < min_p * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    return scaled.softmax(-1)


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SampleResult:
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        tokens[idx] = logits[idx].argmax(-1)
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[idx], [params[i] for i in random_rows])
        race = torch.empty_like(probs).exponential_(generator=default_generator)  # one draw for all rows
        for j, i in enumerate(random_rows):
            if generators[i] is not None:  # seeded rows redraw from their own stream
                race[j].exponential_(generator=generators[i])
        tokens[idx] = (probs / race).argmax(-1)
    want = [p.logprobs for p in params if p.logprobs is not None]
    chosen_lp = top_lp = None
    if want:
        logp = logits.log_softmax(-1)
        chosen_lp = logp.gather(1, tokens[:, None])[:, 0].tolist()
        k = max(want)
        top_lp = []
        if k > 0:
            vals, ids = logp.topk(k, dim=-1)
            vals_l, ids_l = vals.tolist(), ids.tolist()
            for r, p in enumerate(params):
                n = p.logprobs or 0
                top_lp.append(list(zip(ids_l[r][:n], vals_l[r][:n], strict=True)))
        else:
            top_lp = [[] for _ in params]
    return SampleResult(tokens.tolist(), chosen_lp, top_lp)
