"""Choose next tokens for a batch of rows, each with its own SamplingParams and random stream.

Off the critical path at a 128K vocabulary: an all-greedy batch is one argmax; when every sampled
row has a top-k (the usual case), filters run over the top-k candidates from ``torch.topk``, not a
sort of the vocabulary; a full sort is left for top-p without top-k; logprobs are computed only when
asked. The draw is an exponential race (argmax p / E, E ~ Exp(1)), which lets seeded rows use their
own generator without a per-row multinomial call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.sampling.argmax import argmax_rows
from prefixserve.sampling.params import NOT_ARGMAX, SamplingParams, flags_of
from prefixserve.sampling.small_tensors import small_tensor


@dataclass(slots=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row (raw model distribution)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, top-k (token, logprob)


# The most top-k candidates taken with ``torch.topk`` rather than a sort of the whole vocabulary:
# topk's cost grows with k, and past a few thousand a sort is as fast.
TOPK_CAP = 1024


def _filter_sorted(
    sorted_logits: torch.Tensor,  # [R, K] scaled logits, descending (K: all or the top of the vocab)
    sorted_probs: torch.Tensor,  # [R, K] their probabilities under the whole vocabulary's softmax
    params: list[SamplingParams],
) -> torch.Tensor:
    """Drop (to -inf) what min-p, top-k and then top-p drop, in vLLM's order: min-p against the
    likeliest token's probability, top-k by rank, and top-p over the probabilities of what those two
    kept, renormalised; the most likely token always survives."""
    dev, width = sorted_logits.device, sorted_logits.shape[-1]
    rank = torch.arange(width, device=dev)[None, :]
    top_k = small_tensor([p.top_k or width for p in params], dev)[:, None]
    drop = rank >= top_k
    min_p = small_tensor([p.min_p for p in params], dev)[:, None]
    drop |= sorted_probs < min_p * sorted_probs[:, :1]
    kept = sorted_probs.masked_fill(drop, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    top_p = small_tensor([p.top_p for p in params], dev)[:, None]
    drop |= (kept.cumsum(-1) - kept) >= top_p  # keep the token that crosses top_p
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf"))


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return logits / small_tensor([p.temperature for p in params], logits.device)[:, None]


def _top_candidates(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """When every row has a top-k (at most ``TOPK_CAP``): (probs [R, K], their token ids [R, K]) over
    the K = max top-k best tokens, filtered; else None (the whole vocabulary is needed).

    Only the top K are ranked (``torch.topk``, no sort of the vocabulary); their probabilities are the
    whole row's softmax (min-p compares with the likeliest one; top-p renormalises what is kept).
    """
    width = max((p.top_k for p in params), default=0)
    if not params or any(p.top_k == 0 for p in params) or width > min(TOPK_CAP, logits.shape[-1]):
        return None
    scaled = _scaled(logits, params)
    top, ids = scaled.topk(width, dim=-1)  # [R, K], descending
    # the full softmax's values at the top K: exp(x - max) / sum(exp(row - max)), as softmax computes them
    denom = (scaled - top[:, :1]).exp().sum(-1, keepdim=True)
    kept = _filter_sorted(top, (top - top[:, :1]).exp() / denom, params)
    return kept.softmax(-1), ids


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p over the whole vocabulary; logits: [R, V] fp32.

    A full sort only where top-p needs one; min-p alone compares each probability with the row's
    largest, which needs no order.
    """
    scaled = _scaled(logits, params)
    if any(p.top_k or p.top_p < 1.0 for p in params):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        kept = _filter_sorted(sorted_logits, sorted_logits.softmax(-1), params)
        scaled = torch.empty_like(scaled).scatter_(-1, order, kept)
    elif any(p.min_p > 0.0 for p in params):
        probs = scaled.softmax(-1)
        min_p = small_tensor([p.min_p for p in params], logits.device)[:, None]
        scaled = scaled.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return scaled.softmax(-1)


def _draw(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:  # [R] int64
    """The exponential race ``argmax p / E``, E ~ Exp(1) per token; seeded rows draw from their own stream.

    E is drawn over the whole vocabulary in every case, so a seeded row's tokens do not depend on
    which path (top-k candidates or the whole vocabulary) its batch took.
    """
    race = torch.empty_like(logits).exponential_(generator=default_generator)  # one draw for all rows
    for j, gen in enumerate(generators):
        if gen is not None:  # seeded rows redraw from their own stream
            race[j].exponential_(generator=gen)
    top = _top_candidates(logits, params)
    if top is None:
        return (_filtered_probs(logits, params) / race).argmax(-1)
    probs, ids = top  # [R, K]
    return ids.gather(1, (probs / race.gather(1, ids)).argmax(-1, keepdim=True))[:, 0]


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
    device_tokens: torch.Tensor | None = None  # [R] int64 where they were sampled (a later step reads them)

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


def argmax_only(params: list[SamplingParams]) -> bool:
    """True when every row is greedy, none asks for logprobs and none processes its logits: the logits
    need no fp32 copy."""
    return not flags_of(params) & NOT_ARGMAX


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def sample_async(
    logits: torch.Tensor,  # [R, V] fp32 (the model's dtype where ``argmax_only``)
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    processed: torch.Tensor | None = None,
) -> SampleFuture:
    """Launch the sampling of every row; nothing here waits for the device.

    ``processed``: the logits after the request rules' adjusts and ban (bias, penalties), which the
    choice is made from; logprobs are always those of the raw ``logits`` (vLLM's raw logprobs)."""
    raw, logits = logits, (logits if processed is None else processed)
    dev = logits.device
    rows = logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(greedy) == rows:  # the common all-greedy batch: no index tensors
        tokens = argmax_rows(logits)
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=dev)
        if greedy:
            idx = small_tensor(greedy, dev)
            tokens[idx] = argmax_rows(logits[idx])
        idx = small_tensor(random_rows, dev)
        rows_params = [params[i] for i in random_rows]
        tokens[idx] = _draw(logits[idx], rows_params, [generators[i] for i in random_rows], default_generator)
    want = [p.logprobs or 0 for p in params if p.wants_chosen_logprobs]
    chosen_lp = top_vals = top_ids = None
    counts = [p.logprobs or 0 for p in params]
    if want:
        logp = raw.log_softmax(-1)
        chosen_lp = logp.gather(1, tokens[:, None])[:, 0]
        if max(want) > 0:
            top_vals, top_ids = logp.topk(max(want), dim=-1)
    return _future([tokens, chosen_lp, top_vals, top_ids], counts)


def tokens_future(tokens: torch.Tensor) -> SampleFuture:
    """Tokens chosen on the device by other means (tensor parallelism's sharded argmax), on their way
    to the host as ``sample_async``'s are."""
    return _future([tokens, None, None, None], [0] * tokens.shape[0])


def _future(results: list[torch.Tensor | None], counts: list[int]) -> SampleFuture:
    on_device = results[0]
    assert on_device is not None
    event = None
    if on_device.is_cuda:  # into pinned host memory behind the kernels, then one event to wait on
        results = [None if t is None else _pinned_copy(t) for t in results]
        event = torch.cuda.Event()
        event.record()
    return SampleFuture(*results, counts, event, on_device)


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SampleResult:
    """Choose each row's next token (and logprobs when asked); waits for the device."""
    return sample_async(logits, params, generators, default_generator).result()
