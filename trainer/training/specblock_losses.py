"""The SpecBlock loss (docs/specblock.md), without Lightning: the unroll of blocks, the valid prefix, the rank loss.

The LightningModule (trainer/training/specblock.py, whose docstring describes the unroll, the launches, the valid
prefix and the loss terms) and the training-step API (trainer/training/step.py) call these, so the family has one
loss in the codebase. A batch has ``input_ids``, ``loss_mask``, ``position_ids``, ``doc_ids`` (B, T) and the
target's ``features`` and teacher top-k (``trainer.data.features.with_features``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache

from trainer.data.features import teacher_at
from trainer.drafters.attention import context_rule, launch_rule
from trainer.drafters.specblock import SpecBlockDraftModel, rank_class, token_rank
from trainer.losses import draft_teacher, forward_kl_topk, soft_cross_entropy_and_kl, tvd_topk
from trainer.target import Target
from trainer.training.blocks import anchor_generator, sample_anchors


@dataclass(frozen=True)
class SpecBlockOptions:
    """What the SpecBlock loss reads besides the batch: the LightningModule's arguments of the same names."""

    num_blocks: int = 3
    launch: Literal["teacher", "draft"] = "teacher"
    validity: Literal["teacher", "data"] = "teacher"
    slot_decay: float = 0.8
    rank_smoothing: Literal["asymmetric"] | float = "asymmetric"
    rank_distance_weight: bool = True
    rank_class_budget: int = 10
    rank_chain: bool = True
    max_anchors: int | None = None
    launch_chunks: int = 8
    seed: int = 0


# ---- chains (pure functions) -------------------------------------------------------------------------------------
def valid_slots(prefix_ok: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """Slots whose chain is correct before them. Shape: prefix_ok (B, N), match (B, N, K) → (B, N, K) bool.

    Slot ``k`` is valid iff the block's ancestors were correct (``prefix_ok``) and ``match[..., :k]`` all hold;
    a wrong slot keeps its own loss (its prefix was right) and zeroes every later slot of its chain.
    """
    before = torch.cumprod(match.long(), dim=-1).roll(1, dims=-1)
    before[..., 0] = 1
    return prefix_ok[..., None] & before.bool()


def correct_through(prefix_ok: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """Slots whose chain is correct up to and including them. Shape: (B, N), (B, N, K) → (B, N, K) bool."""
    return prefix_ok[..., None] & torch.cumprod(match.long(), dim=-1).bool()


def choose_launch_slots(through: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A slot per block, uniform among those with ``through`` set, else uniform. Shape: (B, N, K) → (B, N) long."""
    noise = torch.rand(through.shape, generator=generator).to(through.device)
    return (noise + through.float()).argmax(-1)


def uniform_launch_slots(shape: torch.Size, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """A slot per block, uniform over ``0..K-1`` whatever the drafts were. Shape: (B, N) long."""
    return torch.randint(block_size, tuple(shape), generator=generator)


def ordinal_targets(classes: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Soft rank-class targets: ``1 - smoothing`` on the class, ``smoothing`` split over its ordinal neighbours
    (all of it to the one neighbour of an end class). Shape: (...) long → (..., C) float."""
    c = torch.arange(num_classes, device=classes.device)
    distance = (c - classes[..., None]).abs()
    neighbours = (distance == 1).float()
    spread = neighbours / neighbours.sum(-1, keepdim=True)
    return (1 - smoothing) * (distance == 0).float() + smoothing * spread


def asymmetric_ordinal_targets(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Soft rank-class targets ``∝ 1 / (1 + |c - t| + max(t - c, 0))²``: a class below the true one ``t`` is
    penalised twice as steeply as one above it. Shape: (...) long → (..., C) float, rows summing to 1."""
    below = classes[..., None] - torch.arange(num_classes, device=classes.device)
    raw = (1.0 + below.abs() + below.clamp(min=0)).float().pow(-2)
    return raw / raw.sum(-1, keepdim=True)


def distance_weights(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """``1 + |t - p| + max(t - p, 0)``: 1 when right, steeper for a predicted class below the true one.
    Shape: (...) long × 2 → (...) float."""
    under = (true - predicted).float()
    return 1.0 + under.abs() + under.clamp(min=0)


def class_balance_weights(
    slot: torch.Tensor, classes: torch.Tensor, mask: torch.Tensor, budget: int, num_slots: int, num_classes: int
) -> torch.Tensor:
    """Per sample ``min(1, budget / count)``, ``count`` the masked samples of its (slot, class) pair; 0 where
    unmasked. Shape: (M,) long, (M,) long, (M,) bool → (M,) float."""
    pair = slot * num_classes + classes
    # float32 whatever the default dtype (bf16-true training sets it to bfloat16).
    counts = torch.zeros(num_slots * num_classes, device=slot.device, dtype=torch.float32)
    counts = counts.index_add(0, pair, mask.float())
    return (budget / counts[pair].clamp(min=1)).clamp(max=1.0) * mask.float()


# ---- one unrolled block -----------------------------------------------------------------------------------------
@dataclass
class BlockResult:
    """One unrolled block of every chain. Heads and teacher are kept for the M slots of live chains under the
    loss mask (row-major order of ``(counted & prefix).nonzero()``); the others carry no loss."""

    # Shape: (B, N, K, H) pre-norm hidden states (the condition of blocks launched from these slots)
    hidden: torch.Tensor
    # Shape: (B, N, K) the drafted (argmax) tokens as target ids; 0 where no head was computed
    draft: torch.Tensor
    # Shape: (B, N, K) bool: labelled inside the sample of a live chain, under the loss mask, teacher in vocabulary
    counted: torch.Tensor
    # Shape: (B, N, K) bool: counted, and the chain was argmax-correct before the slot
    valid: torch.Tensor
    # Shape: (B, N, K) bool: chain argmax-correct up to and including the slot
    through: torch.Tensor
    # Shape: (B, N) row index of each block's token (its position in the packed row)
    start: torch.Tensor
    # Shape: (M,) slot index of each headed slot
    slot: torch.Tensor
    # Shape: (M,) bool: the slot is valid (carries KL); (M,) bool: it carries rank loss
    kl_mask: torch.Tensor
    rank_mask: torch.Tensor
    # Shape: (M, V or Vd) draft logits; (M,) forward KL to the teacher; (M,) TVD; (M,) top-1 agreement
    logits: torch.Tensor
    kl: torch.Tensor
    tvd: torch.Tensor
    top1: torch.Tensor
    # Shape: (M, C) rank-class logits; (M,) rank class of the target's argmax token in the draft distribution
    rank_logits: torch.Tensor
    rank_target: torch.Tensor


# ---- the unroll -----------------------------------------------------------------------------------------
def _score(
    drafter: SpecBlockDraftModel,
    target: Target,
    options: SpecBlockOptions,
    batch: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    start: torch.Tensor,
    origin: torch.Tensor,
    live: torch.Tensor,
    prefix_ok: torch.Tensor,
) -> BlockResult:
    """Labels, teacher, drafts, chain masks and heads of blocks whose tokens sit at row index ``start``
    (B, N). ``origin`` (B, N) is the context row the chain started from (its sample), ``live`` (B, N) whether
    the chain exists at all (a padding anchor does not), ``prefix_ok`` (B, N) whether it was correct so far."""
    ids, doc = batch["input_ids"], batch["doc_ids"]
    t = ids.shape[1]
    k = drafter.block_size
    at = lambda x, index: x.gather(1, index.flatten(1)).view(index.shape)  # noqa: E731
    # Shape: (B, N, K) row index of each slot's label x_{s+1+k}
    label_index = start[..., None] + 1 + torch.arange(k, device=ids.device)
    index = label_index.clamp(max=t - 1)
    origin_doc = at(doc, origin)[..., None]
    labelled = (label_index < t) & (at(doc, index) == origin_doc) & (origin_doc > 0) & live[..., None]

    # The target's distribution one row before the label predicts it.
    teacher_ids, teacher_lp = teacher_at(batch, (index - 1).clamp(min=0))
    counted = labelled & at(batch["loss_mask"], index).bool()
    if drafter.lm_head is not None:
        # A restricted teacher says nothing about a top token outside the draft vocabulary.
        counted &= drafter.t2d[teacher_ids[..., 0]]

    where = (counted & prefix_ok[..., None]).nonzero(as_tuple=True)
    normed = drafter.norm(hidden[where])
    head = lambda x: drafter.logits(x, target.lm_head)  # noqa: E731
    t_ids, t_lp = teacher_ids[where], teacher_lp[where]
    if drafter.lm_head is not None:
        head_ids, head_lp, in_vocab = draft_teacher(t_ids, t_lp, drafter.draft_vocab)
        rank_token = head_ids[:, 0]
    else:
        head_ids, head_lp, in_vocab, rank_token = t_ids, t_lp, None, t_ids[:, 0]
    # Only valid slots carry KL, and which slots are valid follows from the drafts: the head runs without
    # gradient on the M slots (drafts, rank features, metrics), then with gradient on the valid ones only,
    # which is the same loss for a fraction of the head's backward (valid slots are a third or fewer).
    with torch.no_grad():
        # Shape: (M, V or Vd)
        logits = head(normed)
        draft_m = drafter.to_target(logits.argmax(-1))
    draft = torch.zeros(counted.shape, dtype=torch.long, device=ids.device)
    draft[where] = draft_m

    right = teacher_ids[..., 0] if options.validity == "teacher" else at(ids, index)
    match = counted & (draft == right)
    valid = counted & valid_slots(prefix_ok, match)
    kl_mask = valid[where]
    taught = kl_mask.nonzero(as_tuple=True)[0]

    def kl_of(logits: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        if in_vocab is None:
            return forward_kl_topk(logits, head_ids[rows], head_lp[rows])
        return soft_cross_entropy_and_kl(logits, head_ids[rows], head_lp[rows], in_vocab[rows])[1]

    with torch.no_grad():
        kl = kl_of(logits, slice(None))
        tvd = tvd_topk(logits, head_ids, head_lp, support=in_vocab)
    # Shape: (M,) the valid slots' entries differentiable, the others detached (they carry no loss)
    kl = kl.index_put((taught,), kl_of(head(normed[taught]), taught))

    rank_logits = drafter.rank_logits(normed, torch.log_softmax(logits.float(), dim=-1))
    rank_target = rank_class(token_rank(logits, rank_token), drafter.rank_class_bounds)
    if options.rank_chain:
        rank_ok = torch.zeros_like(counted)
        rank_ok[where] = rank_logits.detach().argmax(-1) == rank_target
        rank_mask = (counted & valid_slots(prefix_ok, rank_ok))[where]
    else:
        rank_mask = kl_mask
    return BlockResult(
        hidden=hidden,
        draft=draft,
        counted=counted,
        valid=valid,
        through=correct_through(prefix_ok, match),
        start=start,
        slot=where[2],
        kl_mask=kl_mask,
        rank_mask=rank_mask,
        logits=logits,
        kl=kl,
        tvd=tvd,
        top1=(draft_m == t_ids[:, 0]).float(),
        rank_logits=rank_logits,
        rank_target=rank_target,
    )


def context_blocks(
    drafter: SpecBlockDraftModel, target: Target, batch: dict[str, torch.Tensor], cache: DynamicCache
) -> torch.Tensor:
    """Pre-norm hidden states of the context block of every row (condition ``P f_i``, token ``x_{i+shift}`` at its
    own position; slot ``k`` drafts ``x_{i+shift+1+k}``), their keys entered into ``cache``. The last rows of a
    sample under ``next`` have no token of their sample; their slots have no label there either.
    Shape: batch (B, T) → (B, T, K, H)"""
    ids = batch["input_ids"]
    t = ids.shape[1]
    dtype = drafter.fuse.weight.dtype
    token_rows = (torch.arange(t, device=ids.device) + drafter.token_shift).clamp(max=t - 1).expand_as(ids)
    return drafter(
        drafter.project_features(batch["features"].to(dtype)),
        target.embed_tokens(ids.gather(1, token_rows)).to(dtype),
        batch["position_ids"] + drafter.token_shift,
        context_rule(batch["doc_ids"], drafter.block_size),
        cache,
    )


def launch_blocks(
    drafter: SpecBlockDraftModel,
    condition: torch.Tensor,
    token_embedding: torch.Tensor,
    position_ids: torch.Tensor,
    visible: torch.Tensor,
    anchors: torch.Tensor,
    cache: DynamicCache,
    context_keys: int,
    chunks: int,
) -> torch.Tensor:
    """One launched block per anchor, in ``chunks`` forwards over consecutive anchors; the blocks' keys are
    appended to ``cache`` in anchor order, as one forward would. Shapes: condition, token_embedding (B, A, H),
    position_ids (B, A), visible (B, A, P) the cached keys each block sees, anchors (B, A) their rows,
    ``context_keys`` the T·K keys of the context blocks at the head of the cache → (B, A, K, H).

    A block sees only context keys of rows up to its anchor, and of each earlier launched block only its own
    chain's. A chunk of anchors therefore attends to the context keys up to its last anchor and to the chunk's
    columns of each launched block: the same attention (the dropped keys were masked for every query of the
    chunk) over a fraction of the keys; with every position launching, 8 chunks cut the launched blocks'
    attention to about a third."""
    k = drafter.block_size
    n, p = visible.shape[1:]
    # The cache holds the T·K context keys, then one span of A·K keys per earlier launched level.
    levels = (p - context_keys) // (n * k)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    hidden, new_keys = [], [([], []) for _ in layers]
    bounds = torch.linspace(0, n, min(chunks, n) + 1).round().long().tolist()
    for c0, c1 in itertools.pairwise(bounds):
        if c1 == c0:
            continue
        upto = min((int(anchors[:, c0:c1].max()) + 1) * k, context_keys)
        columns = torch.cat(
            [torch.arange(upto)]
            + [context_keys + level * n * k + torch.arange(c0 * k, c1 * k) for level in range(levels)]
        ).to(visible.device)
        chunk_cache = DynamicCache(config=drafter.config)
        for index, (keys, values) in enumerate(layers):
            chunk_cache.update(keys[:, :, columns], values[:, :, columns], index)
        hidden.append(
            drafter(
                condition[:, c0:c1],
                token_embedding[:, c0:c1],
                position_ids[:, c0:c1],
                launch_rule(visible[:, c0:c1][..., columns], k),
                chunk_cache,
            )
        )
        for index, layer in enumerate(chunk_cache.layers):
            new_keys[index][0].append(layer.keys[:, :, -(c1 - c0) * k :])
            new_keys[index][1].append(layer.values[:, :, -(c1 - c0) * k :])
    for index, (keys, values) in enumerate(new_keys):
        cache.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), index)
    return torch.cat(hidden, dim=1)


def specblock_unroll(
    drafter: SpecBlockDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    options: SpecBlockOptions,
    step: int | None,
) -> list[BlockResult]:
    """The context blocks of every position, then ``num_blocks - 1`` launched blocks per anchor, of a batch with
    features; ``step`` seeds the anchor and launch draws (``None``: the fixed validation draw)."""
    ids, doc, positions = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
    b, t = ids.shape
    k = drafter.block_size
    shift = drafter.token_shift
    dtype = drafter.fuse.weight.dtype
    embed = target.embed_tokens
    generator = anchor_generator(options.seed, step)
    cache = DynamicCache(config=drafter.config)
    rows = torch.arange(t, device=ids.device).expand(b, t)
    hidden = context_blocks(drafter, target, batch, cache)
    live = doc > 0
    results = [_score(drafter, target, options, batch, hidden, rows + shift, rows, live, live)]
    if options.num_blocks == 1:
        return results

    if options.max_anchors is None:
        anchors, anchor_ok = rows, live
    else:
        anchors, anchor_ok = sample_anchors(batch["loss_mask"], doc, options.max_anchors, generator)
    a = anchors.clamp(min=0)
    n = a.shape[1]
    pick = lambda x: x[torch.arange(b, device=ids.device)[:, None], a]  # noqa: E731
    # The block launches start from: hidden (B, A, K, H), drafts and chain state (B, A, K), token rows (B, A)
    prev_hidden, prev_draft, prev_start = pick(results[0].hidden), pick(results[0].draft), a + shift
    prev_through = pick(results[0].through) & anchor_ok[..., None]
    # Shape: (B, A, T·K) the context keys an anchor's chain sees: every slot of the earlier positions of its
    # sample. Keys of the anchor's own context block are added as ancestors at the launch.
    key_row = torch.arange(t, device=ids.device).repeat_interleave(k)
    key_doc = doc.repeat_interleave(k, dim=1)
    anchor_doc = doc.gather(1, a)
    visible = (key_row < a[..., None]) & (key_doc[:, None, :] == anchor_doc[..., None]) & anchor_ok[..., None]
    # Shape: (B, A, K) cache index of each slot of the block a launch starts from
    slot = torch.arange(k, device=ids.device)
    prev_keys = a[..., None] * k + slot

    for _ in range(options.num_blocks - 1):
        if options.launch == "teacher":
            j = uniform_launch_slots(a.shape, k, generator).to(ids.device)
            start = prev_start + 1 + j
            token = ids.gather(1, start.clamp(max=t - 1))
            prefix_ok = anchor_ok
        else:
            j = choose_launch_slots(prev_through, generator)
            start = prev_start + 1 + j
            token = prev_draft.gather(2, j[..., None]).squeeze(2)
            prefix_ok = prev_through.gather(2, j[..., None]).squeeze(2)
        visible = visible | torch.zeros_like(visible).scatter(2, prev_keys, slot <= j[..., None])
        condition = prev_hidden.gather(2, j[..., None, None].expand(-1, -1, 1, prev_hidden.shape[-1])).squeeze(2)
        cached = cache.get_seq_length(0)
        hidden = launch_blocks(
            drafter, condition, embed(token).to(dtype), pick(positions) + (start - a), visible, a, cache, t * k,
            options.launch_chunks,
        )  # fmt: skip
        result = _score(drafter, target, options, batch, hidden, start, a, anchor_ok, prefix_ok)
        results.append(result)
        prev_hidden, prev_draft, prev_start, prev_through = hidden, result.draft, start, result.through
        # The new block's keys follow the cache; its slots become ancestors only through the next launch.
        visible = torch.cat([visible, torch.zeros(b, n, n * k, dtype=torch.bool, device=ids.device)], dim=-1)
        prev_keys = cached + torch.arange(n, device=ids.device)[None, :, None] * k + slot
    return results


# ---- losses ---------------------------------------------------------------------------------------------
def _slot_means(
    values: list[torch.Tensor], results: list[BlockResult], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (block, slot) means of per-slot ``values`` (M,) each over the valid slots, and which (block, slot)
    have any. Shape: (n_blocks, K) × 2."""
    k = block_size
    means, present = [], []
    for v, r in zip(values, results, strict=True):
        m = r.kl_mask.to(v.dtype)
        count = torch.zeros(k, dtype=v.dtype, device=v.device).index_add(0, r.slot, m)
        total = torch.zeros(k, dtype=v.dtype, device=v.device).index_add(0, r.slot, v * m)
        means.append(total / count.clamp(min=1))
        present.append(count > 0)
    return torch.stack(means), torch.stack(present)


def rank_loss(r: BlockResult, options: SpecBlockOptions, block_size: int) -> torch.Tensor:
    """One block's rank loss: the weighted mean soft cross-entropy over its rank slots (module docstring)."""
    num_classes = r.rank_logits.shape[-1]
    if options.rank_smoothing == "asymmetric":
        soft = asymmetric_ordinal_targets(r.rank_target, num_classes)
    else:
        soft = ordinal_targets(r.rank_target, num_classes, float(options.rank_smoothing))
    ce = -(soft * r.rank_logits.float().log_softmax(-1)).sum(-1)
    if options.rank_distance_weight:
        ce = ce * distance_weights(r.rank_logits.detach().argmax(-1), r.rank_target)
    if options.rank_class_budget > 0:
        weight = class_balance_weights(
            r.slot, r.rank_target, r.rank_mask, options.rank_class_budget, block_size, num_classes
        )
    else:
        weight = r.rank_mask.float()
    return (ce * weight).sum() / weight.sum().clamp(min=1e-8)


@dataclass(frozen=True)
class SpecBlockLoss:
    """The SpecBlock loss of a batch (module docstring of trainer/training/specblock.py) and its parts; each a
    scalar tensor."""

    loss: torch.Tensor
    kl: torch.Tensor
    rank: torch.Tensor
    # The share of counted slots (live chains under the loss mask) that were valid drafts.
    valid_fraction: torch.Tensor


def specblock_losses(results: list[BlockResult], options: SpecBlockOptions, block_size: int) -> SpecBlockLoss:
    """The loss of the unrolled blocks ``results``, with its KL and rank parts."""
    kl_means, present = _slot_means([r.kl for r in results], results, block_size)
    p = present.float()
    # Shape: (K,) the mean over blocks of each slot's mean KL
    kl_per_slot = (kl_means * p).sum(0) / p.sum(0).clamp(min=1)
    decay = options.slot_decay ** torch.arange(kl_per_slot.shape[0], device=kl_per_slot.device, dtype=torch.float32)
    kl_loss = (decay * kl_per_slot).sum()
    ranked = [r for r in results if r.rank_mask.any()]
    rank = sum((rank_loss(r, options, block_size) for r in ranked), torch.zeros((), device=kl_loss.device))
    rank = rank / max(len(ranked), 1)
    counted = sum(r.counted.sum() for r in results)
    valid_fraction = sum(r.valid.sum() for r in results) / counted.clamp(min=1)
    return SpecBlockLoss(kl_loss + rank, kl_loss, rank, valid_fraction)
