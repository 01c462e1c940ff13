"""Functions over next-token distributions, each defined once: nucleus (top-p) filtering and the draw of a token,
shared by speculative verification (``trainer.decoding.verify``) and data regeneration (``trainer.data.regenerate``),
so that both sample from the same warped distribution the same way; and the exact top-k of vocabulary-wide rows
that greedy verification, the verifier log's recorder and Token Recycling's adjacency take every step."""

from __future__ import annotations

import torch


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` kept on the smallest set of most likely tokens whose mass reaches ``top_p`` (the token that
    crosses it included, so never empty) and renormalised there. Shape: (..., V) → (..., V)"""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index drawn with probability ``probs[i] / probs.sum()``: one uniform draw from ``generator`` placed in the
    float64 cumulative sum (``torch.multinomial`` measured 200 us for 8192 probabilities on CPU, this 15 us). A
    zero probability is never drawn: the first cumulative value above the draw is taken, and a draw that rounds up
    to the total takes the last index with a positive probability. The generator may live on another device than
    ``probs`` (a server's per-request CPU generator with the model on a GPU): the draw is made there and moved.
    Shape: (V,) → () long"""
    cdf = probs.double().cumsum(-1)
    total = cdf[-1:]
    where = probs.device if generator is None else generator.device
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=where).to(probs.device) * total
    return torch.minimum(torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, total))[0]


# Width of the chunks whose maxima pre-select the top-k (see ``top_rows``); 64 measured fastest for 8192 to 152k.
CHUNK = 64


def top_rows(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of every row: (indices, values), values descending. Shape: (R, V) → (R, k) each. Column 0 is
    the first index of the row's maximum, as ``argmax`` gives it: greedy verification takes it for the target's
    choice, which must tie-break as the target's own greedy decoding does.

    A full-width ``topk`` (or ``argmax``) over a vocabulary costs more than a pass over it, so it runs in two
    stages: the maximum of every chunk of ``CHUNK`` values (a contiguous reduction), then ``topk`` over the k
    chunks with the largest maxima only. Exact: each of a row's k best values lies in a chunk whose maximum is at
    least that value, and at most k - 1 other chunks can have a larger one."""
    rows, vocab = values.shape
    # Below about 32k values the two stages' fixed costs exceed a full topk (measured: 4 rows of 8192 break even).
    host = _host_argmax(values)
    if vocab % CHUNK or vocab // CHUNK < k or values.numel() < 4 * 8192:
        ids = values.argmax(-1) if host is None else host
        if k == 1:
            return ids[:, None], values.gather(-1, ids[:, None])
        top = values.topk(k, dim=-1)
        return _first_max_first(top.indices, ids), top.values
    per_row = vocab // CHUNK
    chunks = values.view(rows, per_row, CHUNK)
    maxima = chunks.amax(-1)
    if host is not None:
        first = host
    else:
        # The first index of the maximum: the first chunk holding it, then the first position there (argmax
        # returns the first of equal values; over (R, V / CHUNK) and (R, CHUNK) it is cheap).
        high = maxima.amax(-1, keepdim=True)
        first_chunk = (maxima == high).to(torch.uint8).argmax(-1)
        within = (chunks[torch.arange(rows, device=high.device), first_chunk] == high).to(torch.uint8).argmax(-1)
        first = first_chunk * CHUNK + within
    if k == 1:
        return first[:, None], values.gather(-1, first[:, None])
    # Shape: (R, k) chunk indices, in no order (the second stage sorts; unsorted measured ~10% faster).
    best = maxima.topk(k, dim=-1, sorted=False).indices
    # Whole chunks are contiguous rows of this view: index_select copies them (cheaper than an element gather).
    chunk_rows = (best + torch.arange(rows, device=best.device)[:, None] * per_row).view(-1)
    candidates = values.reshape(-1, CHUNK).index_select(0, chunk_rows).view(rows, k * CHUNK)
    top = candidates.topk(k, dim=-1)
    ids = best.gather(1, top.indices // CHUNK) * CHUNK + top.indices % CHUNK
    return _first_max_first(ids, first), top.values


def _host_argmax(values: torch.Tensor) -> torch.Tensor | None:
    """The first index of every row's maximum by numpy, for fp32/fp64 rows on the CPU (None elsewhere): numpy's
    argmax is one vectorised pass, about 20x torch's CPU argmax (measured at 32 x 8192: 0.02 against 0.44 ms);
    both return the first of equal values. Shape: (R, V) → (R,) long."""
    if values.device.type != "cpu" or values.dtype not in (torch.float32, torch.float64):
        return None
    return torch.from_numpy(values.detach().numpy().argmax(-1))


def _first_max_first(ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``ids`` (R, k), a top-k whose column 0 holds some index of the row maximum, with ``first`` (R,), the first
    such index, in column 0: swapped there from its column when the top-k holds it (tied values, so the values
    keep their order and no id repeats), else written over column 0 (more ties than k: both are maxima)."""
    match = ids == first[:, None]
    column = match.to(torch.uint8).argmax(-1)
    rows = torch.arange(ids.shape[0], device=ids.device)
    ids[rows, column] = torch.where(match.any(-1), ids[:, 0], ids[rows, column])
    ids[:, 0] = first
    return ids
