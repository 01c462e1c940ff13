"""SpecBlock training (docs/specblock.md): a test-time-training unroll of blocks, valid prefix, rank head.

Every position ``i`` of a row is a context block (condition ``P f_i``, token ``x_{i+s}`` with ``s`` the drafter's
token shift: 1 for the ``next`` alignment, 0 for ``same``); slot ``k`` is labelled ``x_{i+s+1+k}`` and distilled
from the target's distribution one row earlier (forward KL on the teacher's top-k, restricted to the draft
vocabulary when the drafter has its own head). Then ``num_blocks - 1`` more blocks are launched in turn, each from
one slot ``j`` of the block before, with that slot's pre-norm hidden state as condition, attending to what the
launching slot saw plus that block's slots ``<= j``: exactly what tree drafting does at inference, run through the
same ``DynamicCache`` calls. ``launch`` says how:

- ``teacher`` (the authors' code, the default): every position launches (``max_anchors: null``), the launch slot
  is drawn uniformly (``M ~ U{1..K}``, here per chain), the block's token is the data token at that slot, and no
  filter runs between blocks: the valid prefix restarts in every block. A filter on "the chain was right so far"
  would train only the launches inference makes from the greedy path, never those from its branches.
- ``draft``: up to ``max_anchors`` positions launch, from a slot drawn among those whose chain is still right
  through it, with the drafter's argmax token as input, and the valid prefix runs through the whole chain.

Valid prefix: a slot counts only if every earlier slot of its chain drafted the right token by argmax, where
``validity`` says what is right: ``teacher`` (default) the target's argmax, the token the verifier would accept
(on target-regenerated data it is the data token wherever the target wrote the data greedily); ``data`` the
data token.

Loss: ``Σ_k decay^k KL_k + rank_loss``. ``KL_k`` averages the per-block means of the valid slots ``k`` (each
unrolled block weighs as much as the context blocks). The rank head learns the class of the target's argmax
token's rank in the draft distribution by a soft cross-entropy with four parts, each a recipe switch (the
authors' settings are the defaults):

- ``rank_smoothing``: ``asymmetric`` targets ``∝ 1 / (1 + |c - t| + max(t - c, 0))²`` (more mass on classes above
  the true one, whose only cost is a wider branch), or a float: symmetric ordinal smoothing of that mass;
- ``rank_distance_weight``: a sample's loss is scaled by ``1 + |t - p| + max(t - p, 0)`` (``p`` the predicted
  class): predicting too low a class, which prunes the target's token, costs twice the slope of too high;
- ``rank_class_budget``: within each block and slot, class ``c`` weighs ``min(1, budget / count_c)``, so a
  frequent class (the top-1 class of a good drafter) cannot drown the rare ones; 0 turns it off;
- ``rank_chain``: the rank head trains on a block's slots up to and including its first misprediction of the
  rank class (independent of the drafted tokens); off, it trains on the valid-prefix slots.
The rank loss is the weighted mean over its slots, averaged over blocks.

Recipe ``recipes/specblock_tiny.yaml`` trains on the shipped tiny target; on CPU::

    trainer fit --recipe specblock_tiny --trainer.max_steps 20
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import DynamicCache, PreTrainedModel

from trainer.data.features import teacher_at, with_features
from trainer.drafters.specblock import (
    SpecBlockDraftModel,
    build_config,
    context_mask,
    launch_mask,
    rank_class,
    token_rank,
)
from trainer.errors import UserError
from trainer.losses import draft_teacher, forward_kl_topk, soft_cross_entropy_and_kl, tvd_topk
from trainer.training.block_batches import anchor_generator, sample_anchors
from trainer.training.frozen_target import FrozenTargetTraining
from trainer.training.metrics import show_table


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
    counts = torch.zeros(num_slots * num_classes, device=slot.device).index_add(0, pair, mask.float())
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


class SpecBlockTraining(FrozenTargetTraining):
    """Trains a SpecBlock drafter against a frozen target.

    Args:
        target: HF causal LM (directory or hub id); its embedding feeds the drafter.
        num_layers: drafter decoder layers.
        block_size: slots per block, K.
        num_blocks: blocks per chain in the unroll (the context block, then num_blocks - 1 launched ones).
        alignment: ``next`` pairs the features of position i with x_{i+1} (the root block is then the newest
            context block at inference); ``same`` with x_i.
        draft_vocab_size: the drafter's own LM head over this many most frequent training tokens, initialised
            from the target's rows; ``null`` drafts through the target's frozen full head.
        launch: ``teacher`` (uniform launch slot, data token, every position, no filter between blocks) or
            ``draft`` (slot among the still-correct ones, argmax token, ``max_anchors`` positions, chain carried).
        validity: what the valid prefix compares drafts with: ``teacher`` (the target's argmax) or ``data``.
        slot_decay: KL weight ``slot_decay ** k`` of slot k.
        rank_smoothing: ``asymmetric``, or a float: symmetric ordinal label smoothing of that mass.
        rank_distance_weight: scale the rank loss by the asymmetric distance of the predicted class.
        rank_class_budget: per (block, slot) class weight ``min(1, budget / count)``; 0 turns it off.
        rank_chain: train the rank head up to its first misprediction in a block, else on the valid slots.
        max_anchors: positions per row that launch the unrolled blocks; ``null``: every position.
        launch_chunks: forwards per launched level, over consecutive anchors, each attending only to the keys its
            anchors can see (the same values as one forward, for less attention work).
        target_layer_ids: target layers read; default EAGLE-3's ``[1, L//2 - 1, L - 4]``.
        intermediate_size: drafter MLP width; default the target's.
        rank_hidden_size: hidden width of the rank head's MLP.
        init_from: continue from this SpecBlock HF directory instead of a random init.
        seed: anchor and launch-slot sampling seed.

    The other arguments: see :class:`~trainer.training.frozen_target.FrozenTargetTraining`.
    """

    def __init__(
        self,
        target: str,
        num_layers: int = 2,
        block_size: int = 4,
        num_blocks: int = 3,
        alignment: Literal["next", "same"] = "next",
        draft_vocab_size: int | None = 32000,
        launch: Literal["teacher", "draft"] = "teacher",
        validity: Literal["teacher", "data"] = "teacher",
        slot_decay: float = 0.8,
        rank_smoothing: Literal["asymmetric"] | float = "asymmetric",
        rank_distance_weight: bool = True,
        rank_class_budget: int = 10,
        rank_chain: bool = True,
        max_anchors: int | None = None,
        launch_chunks: int = 8,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        rank_hidden_size: int = 256,
        init_from: str | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if num_blocks < 1:
            raise UserError(f"model.num_blocks must be at least 1 (the context block), got {num_blocks}")
        if rank_smoothing != "asymmetric" and not (
            isinstance(rank_smoothing, float | int) and 0.0 <= rank_smoothing < 1.0
        ):
            raise UserError(f"model.rank_smoothing must be 'asymmetric' or a float in [0, 1), got {rank_smoothing!r}")
        if max_anchors is not None and max_anchors < 1:
            raise UserError(f"model.max_anchors must be at least 1 or null (every position), got {max_anchors}")
        if launch_chunks < 1:
            raise UserError(f"model.launch_chunks must be at least 1, got {launch_chunks}")
        if rank_class_budget < 0:
            raise UserError(
                f"model.rank_class_budget must be >= 0 (0 turns class balancing off), got {rank_class_budget}"
            )
        super().__init__(target=target, **kwargs)
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.alignment = alignment
        self.draft_vocab_size = draft_vocab_size
        self.launch = launch
        self.validity = validity
        self.slot_decay = slot_decay
        self.rank_smoothing = rank_smoothing
        self.rank_distance_weight = rank_distance_weight
        self.rank_class_budget = rank_class_budget
        self.rank_chain = rank_chain
        self.max_anchors = max_anchors
        self.launch_chunks = launch_chunks
        self.target_layer_ids = target_layer_ids
        self.intermediate_size = intermediate_size
        self.rank_hidden_size = rank_hidden_size
        self.init_from = init_from
        self.seed = seed

    family = "SpecBlock"

    # ---- model --------------------------------------------------------------------------------------------
    def build_drafter(self, target: PreTrainedModel) -> SpecBlockDraftModel:
        if self.init_from:
            return self.load_drafter(SpecBlockDraftModel, self.init_from)
        overrides = {"intermediate_size": self.intermediate_size} if self.intermediate_size else {}
        vocab_size = target.config.get_text_config().vocab_size
        draft_vocab_size = min(self.draft_vocab_size, vocab_size) if self.draft_vocab_size else None
        config = build_config(
            target.config,
            self.num_layers,
            self.block_size,
            self.target_layer_ids,
            self.rank_hidden_size,
            alignment=self.alignment,
            draft_vocab_size=draft_vocab_size,
            **overrides,
        )
        drafter = SpecBlockDraftModel(config)
        if draft_vocab_size:
            self.adopt_training_vocab(drafter, target, init_head=True)
        return drafter

    # ---- the unroll ---------------------------------------------------------------------------------------
    def _score(
        self,
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
        drafter = self.drafter
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
        head = lambda x: drafter.logits(x, self.target.lm_head)  # noqa: E731
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

        right = teacher_ids[..., 0] if self.validity == "teacher" else at(ids, index)
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
        if self.rank_chain:
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

    def _launch(
        self,
        condition: torch.Tensor,
        token_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        visible: torch.Tensor,
        anchors: torch.Tensor,
        cache: DynamicCache,
        context_keys: int,
    ) -> torch.Tensor:
        """One launched block per anchor, in ``launch_chunks`` forwards over consecutive anchors; the blocks'
        keys are appended to ``cache`` in anchor order, as one forward would. Shapes: condition, token_embedding
        (B, A, H), position_ids (B, A), visible (B, A, P) the cached keys each block sees, anchors (B, A) their
        rows, ``context_keys`` the T·K keys of the context blocks at the head of the cache → (B, A, K, H).

        A block sees only context keys of rows up to its anchor, and of each earlier launched block only its own
        chain's. A chunk of anchors therefore attends to the context keys up to its last anchor and to the
        chunk's columns of each launched block: the same attention (the dropped keys were masked for every
        query of the chunk) over a fraction of the keys; with every position launching, 8 chunks cut the
        launched blocks' attention to about a third."""
        drafter = self.drafter
        k = drafter.block_size
        n, p = visible.shape[1:]
        # The cache holds the T·K context keys, then one span of A·K keys per earlier launched level.
        levels = (p - context_keys) // (n * k)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        hidden, new_keys = [], [([], []) for _ in layers]
        bounds = torch.linspace(0, n, min(self.launch_chunks, n) + 1).round().long().tolist()
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
                    launch_mask(visible[:, c0:c1][..., columns], k),
                    chunk_cache,
                )
            )
            for index, layer in enumerate(chunk_cache.layers):
                new_keys[index][0].append(layer.keys[:, :, -(c1 - c0) * k :])
                new_keys[index][1].append(layer.values[:, :, -(c1 - c0) * k :])
        for index, (keys, values) in enumerate(new_keys):
            cache.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), index)
        return torch.cat(hidden, dim=1)

    def unroll(self, batch: dict[str, torch.Tensor]) -> list[BlockResult]:
        """The context blocks of every position, then ``num_blocks - 1`` launched blocks per anchor."""
        batch = with_features(batch, self.target, self.topk)
        drafter = self.drafter
        ids, doc, positions = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
        b, t = ids.shape
        k = drafter.block_size
        shift = drafter.token_shift
        dtype = drafter.fuse.weight.dtype
        embed = self.target.embed_tokens
        generator = anchor_generator(self.seed, self.global_step if self.training else None)
        cache = DynamicCache(config=drafter.config)

        rows = torch.arange(t, device=ids.device).expand(b, t)
        # Context block of row i: condition P f_i, token x_{i+shift} at its own position (the last rows of a
        # sample under `next` have no token of their sample; their slots have no label there either).
        token_rows = (rows + shift).clamp(max=t - 1)
        hidden = drafter(
            drafter.project_features(batch["features"].to(dtype)),
            embed(ids.gather(1, token_rows)).to(dtype),
            positions + shift,
            context_mask(doc, k)[:, None],
            cache,
        )
        live = doc > 0
        results = [self._score(batch, hidden, rows + shift, rows, live, live)]
        if self.num_blocks == 1:
            return results

        if self.max_anchors is None:
            anchors, anchor_ok = rows, live
        else:
            anchors, anchor_ok = sample_anchors(batch["loss_mask"], doc, self.max_anchors, generator)
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

        for _ in range(self.num_blocks - 1):
            if self.launch == "teacher":
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
            hidden = self._launch(
                condition, embed(token).to(dtype), pick(positions) + (start - a), visible, a, cache, t * k
            )
            result = self._score(batch, hidden, start, a, anchor_ok, prefix_ok)
            results.append(result)
            prev_hidden, prev_draft, prev_start, prev_through = hidden, result.draft, start, result.through
            # The new block's keys follow the cache; its slots become ancestors only through the next launch.
            visible = torch.cat([visible, torch.zeros(b, n, n * k, dtype=torch.bool, device=ids.device)], dim=-1)
            prev_keys = cached + torch.arange(n, device=ids.device)[None, :, None] * k + slot
        return results

    # ---- losses -------------------------------------------------------------------------------------------
    def _slot_means(self, values: list[torch.Tensor], results: list[BlockResult]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (block, slot) means of per-slot ``values`` (M,) each over the valid slots, and which (block, slot)
        have any. Shape: (n_blocks, K) × 2."""
        k = self.drafter.block_size
        means, present = [], []
        for v, r in zip(values, results, strict=True):
            m = r.kl_mask.to(v.dtype)
            count = torch.zeros(k, dtype=v.dtype, device=v.device).index_add(0, r.slot, m)
            total = torch.zeros(k, dtype=v.dtype, device=v.device).index_add(0, r.slot, v * m)
            means.append(total / count.clamp(min=1))
            present.append(count > 0)
        return torch.stack(means), torch.stack(present)

    def rank_loss(self, r: BlockResult) -> torch.Tensor:
        """One block's rank loss: the weighted mean soft cross-entropy over its rank slots (module docstring)."""
        num_classes = r.rank_logits.shape[-1]
        if self.rank_smoothing == "asymmetric":
            soft = asymmetric_ordinal_targets(r.rank_target, num_classes)
        else:
            soft = ordinal_targets(r.rank_target, num_classes, float(self.rank_smoothing))
        ce = -(soft * r.rank_logits.float().log_softmax(-1)).sum(-1)
        if self.rank_distance_weight:
            ce = ce * distance_weights(r.rank_logits.detach().argmax(-1), r.rank_target)
        if self.rank_class_budget > 0:
            weight = class_balance_weights(
                r.slot, r.rank_target, r.rank_mask, self.rank_class_budget, self.drafter.block_size, num_classes
            )
        else:
            weight = r.rank_mask.float()
        return (ce * weight).sum() / weight.sum().clamp(min=1e-8)

    def losses(self, results: list[BlockResult]) -> dict[str, torch.Tensor]:
        kl_means, present = self._slot_means([r.kl for r in results], results)
        p = present.float()
        # Shape: (K,) the mean over blocks of each slot's mean KL
        kl_per_slot = (kl_means * p).sum(0) / p.sum(0).clamp(min=1)
        decay = self.slot_decay ** torch.arange(kl_per_slot.shape[0], device=kl_per_slot.device, dtype=torch.float32)
        kl_loss = (decay * kl_per_slot).sum()
        ranked = [r for r in results if r.rank_mask.any()]
        rank_loss = sum((self.rank_loss(r) for r in ranked), torch.zeros((), device=kl_loss.device))
        rank_loss = rank_loss / max(len(ranked), 1)
        counted = sum(r.counted.sum() for r in results)
        return {
            "loss": kl_loss + rank_loss,
            "kl": kl_loss,
            "rank": rank_loss,
            "valid_fraction": sum(r.valid.sum() for r in results) / counted.clamp(min=1),
        }

    def training_step(self, batch, batch_idx):
        out = self.losses(self.unroll(batch))
        self.log("train/loss", out["loss"], prog_bar=True)
        self.log("train/kl", out["kl"])
        self.log("train/rank", out["rank"])
        self.log("train/valid_fraction", out["valid_fraction"])
        return out["loss"]

    def validation_step(self, batch, batch_idx):
        results = self.unroll(batch)
        out = self.losses(results)
        self.log("val/loss", out["loss"], prog_bar=True, sync_dist=True)
        self.log("val/kl", out["kl"], sync_dist=True)
        self.log("val/rank", out["rank"], sync_dist=True)
        self.accumulate_depth_metrics(results)

    # ---- metrics ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def accumulate_depth_metrics(self, results: list[BlockResult]) -> None:
        """Sums per (block, slot): counted and valid slots; over valid slots top-1 agreement with the target's
        argmax, TVD to the target, rank-head accuracy and how often the head predicts the last class."""
        k = self.drafter.block_size
        last = len(self.drafter.rank_class_bounds)
        stats: dict[str, list[torch.Tensor]] = {
            "counted": [],
            "valid": [],
            "top1": [],
            "tvd": [],
            "rank_acc": [],
            "stop": [],
        }
        for r in results:
            per_slot = lambda v: torch.zeros(k, device=v.device).index_add(0, r.slot, v.float() * r.kl_mask)  # noqa: E731, B023
            predicted = r.rank_logits.argmax(-1)
            stats["counted"].append(r.counted.float().sum(dim=(0, 1)))
            stats["valid"].append(r.valid.float().sum(dim=(0, 1)))
            stats["top1"].append(per_slot(r.top1))
            stats["tvd"].append(per_slot(r.tvd))
            stats["rank_acc"].append(per_slot(predicted == r.rank_target))
            stats["stop"].append(per_slot(predicted == last))
        # Shape: (n_blocks, K) per stat
        self.val_sums.add({key: torch.stack(values) for key, values in stats.items()})

    def depth_table(self) -> dict[str, list[list[float]]]:
        """``{stat: [[value at slot 0..K-1] per block]}``: valid is the share of counted slots (labelled, under
        the loss mask) whose chain was correct before them; top1, tvd, rank_acc and stop (the head predicts the
        last class) are means over valid slots."""
        if not self.val_sums:
            return {}
        out = {"valid": self.val_sums.mean("valid", "counted").tolist(), "count": self.val_sums["valid"].tolist()}
        for stat in ("top1", "tvd", "rank_acc", "stop"):
            out[stat] = self.val_sums.mean(stat, "valid").tolist()
        return out

    def validation_metrics(self) -> dict[str, float]:
        table = self.depth_table()
        return {
            f"val_depth/{stat}/b{block + 1}s{slot}": value
            for stat in ("valid", "top1", "tvd", "rank_acc", "stop")
            for block, row in enumerate(table.get(stat, []))
            for slot, value in enumerate(row)
            if table["count"][block][slot] > 0
        }

    def print_table(self) -> None:
        """Per (block, slot): share of valid slots, top-1 agreement, TVD, rank-head accuracy and stop share."""
        table = self.depth_table()
        if not table:
            return
        show_table(
            "SpecBlock per (block, slot) on validation: valid = chain correct before the slot",
            ["block", "slot", "valid", "top1", "tvd", "rank acc", "stop", "n valid"],
            [
                [
                    str(block + 1),
                    str(slot),
                    *[f"{table[stat][block][slot]:.3f}" for stat in ("valid", "top1", "tvd", "rank_acc", "stop")],
                    str(int(count)),
                ]
                for block, counts in enumerate(table["count"])
                for slot, count in enumerate(counts)
            ],
        )
