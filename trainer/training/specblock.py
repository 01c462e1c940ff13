"""SpecBlock training (docs/algorithms.md §5): a test-time-training unroll of blocks, valid-prefix mask, rank head.

Every position ``i`` of a row is a context block (condition ``P f_i``, token ``x_i``); its slot ``k`` is labelled
``x_{i+1+k}`` and distilled from the target's distribution at ``i+k`` (forward KL on the teacher's top-k). Up to
``max_anchors`` positions per row then launch ``num_blocks - 1`` more blocks in turn, each from one slot ``j`` of the
block before, with that slot's pre-norm hidden state as condition and its argmax token as input, attending to
what the launching slot saw plus that block's slots ``<= j``: exactly what tree drafting does at inference, run
through the same ``DynamicCache`` calls. The launch slot is drawn uniformly among the slots whose chain is still
argmax-correct through it (uniformly among all when none is), so that unrolled blocks mostly train on prefixes
the drafter does produce.

Valid-prefix mask: a slot counts only if every earlier slot of its chain (the earlier slots of its block, and the
launch slot and the slots before it in each ancestor block) drafted the data token by argmax. Correctness is
measured against the data token, not the target's argmax, because the teacher at each slot is the target's
distribution given the data prefix: only a chain that drafted that prefix is trained on the context its teacher
saw. Loss: ``Σ_k 0.8^k KL_k + rank_loss``, where ``KL_k`` averages the per-block means of the valid slots ``k`` (each
unrolled block weighs as much as the context blocks, as every unrolled step does in EAGLE-3's training), and
``rank_loss`` is the soft cross-entropy of the rank head against the rank class of the target's argmax token in
the draft distribution, with ordinal label smoothing, over the same valid slots.

Recipe ``recipes/specblock_tiny.yaml`` trains on the shipped tiny target; on CPU::

    trainer fit --recipe specblock_tiny --trainer.max_steps 20
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
from trainer.losses import forward_kl_topk, tvd_topk
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


def ordinal_targets(classes: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Soft rank-class targets: ``1 - smoothing`` on the class, ``smoothing`` split over its ordinal neighbours
    (all of it to the one neighbour of an end class). Shape: (...) long → (..., C) float."""
    c = torch.arange(num_classes, device=classes.device)
    distance = (c - classes[..., None]).abs()
    neighbours = (distance == 1).float()
    spread = neighbours / neighbours.sum(-1, keepdim=True)
    return (1 - smoothing) * (distance == 0).float() + smoothing * spread


# ---- one unrolled block -----------------------------------------------------------------------------------------
@dataclass
class BlockResult:
    """One unrolled block of every chain. The heads and the teacher are kept for the M valid slots only (row-major
    order of ``valid.nonzero()``): the others carry no loss, and skipping them halves a step's cost."""

    # Shape: (B, N, K, H) pre-norm hidden states (the condition of blocks launched from these slots)
    hidden: torch.Tensor
    # Shape: (B, N, K) the drafted (argmax) tokens
    draft: torch.Tensor
    # Shape: (B, N, K) bool: labelled inside the sample of a live chain and under the loss mask
    counted: torch.Tensor
    # Shape: (B, N, K) bool: counted, and the chain was argmax-correct before the slot
    valid: torch.Tensor
    # Shape: (B, N, K) bool: chain argmax-correct up to and including the slot
    through: torch.Tensor
    # Shape: (B, N) row index of each block's token (its position in the packed row)
    start: torch.Tensor
    # Shape: (M,) slot index of each valid slot
    slot: torch.Tensor
    # Shape: (M, V) draft logits of the valid slots
    logits: torch.Tensor
    # Shape: (M, C) rank-class logits
    rank_logits: torch.Tensor
    # Shape: (M,) rank class of the target's argmax token in the draft distribution
    rank_target: torch.Tensor
    # Shape: (M, k) the teacher's top-k ids / log-probs
    teacher_ids: torch.Tensor
    teacher_lp: torch.Tensor


class SpecBlockTraining(FrozenTargetTraining):
    """Trains a SpecBlock drafter against a frozen target.

    Args:
        target: HF causal LM (directory or hub id); its embedding and LM head are the drafter's.
        num_layers: drafter decoder layers.
        block_size: slots per block, K.
        num_blocks: blocks per chain in the unroll (the context block, then num_blocks - 1 launched ones).
        slot_decay: KL weight ``slot_decay ** k`` of slot k.
        rank_smoothing: ordinal label smoothing of the rank loss.
        max_anchors: positions per row that launch the unrolled blocks.
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
        slot_decay: float = 0.8,
        rank_smoothing: float = 0.1,
        max_anchors: int = 64,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        rank_hidden_size: int = 256,
        init_from: str | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if num_blocks < 1:
            raise UserError(f"model.num_blocks must be at least 1 (the context block), got {num_blocks}")
        if not 0.0 <= rank_smoothing < 1.0:
            raise UserError(f"model.rank_smoothing must be in [0, 1), got {rank_smoothing}")
        if max_anchors < 1:
            raise UserError(f"model.max_anchors must be at least 1, got {max_anchors}")
        super().__init__(target=target, **kwargs)
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slot_decay = slot_decay
        self.rank_smoothing = rank_smoothing
        self.max_anchors = max_anchors
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
        config = build_config(
            target.config, self.num_layers, self.block_size, self.target_layer_ids, self.rank_hidden_size, **overrides
        )
        return SpecBlockDraftModel(config)

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
        k = self.drafter.block_size
        at = lambda x, index: x.gather(1, index.flatten(1)).view(index.shape)  # noqa: E731
        # Shape: (B, N, K) row index of each slot's label x_{s+1+k}
        label_index = start[..., None] + 1 + torch.arange(k, device=ids.device)
        index = label_index.clamp(max=t - 1)
        origin_doc = at(doc, origin)[..., None]
        labelled = (label_index < t) & (at(doc, index) == origin_doc) & (origin_doc > 0) & live[..., None]
        counted = labelled & at(batch["loss_mask"], index).bool()

        # The target's distribution at s+k predicts the label; index >= 1 since s >= 0.
        teacher_ids, teacher_lp = teacher_at(batch, index - 1)

        normed = self.drafter.norm(hidden)
        with torch.no_grad():
            draft = self.target.lm_head(normed).argmax(-1)
        match = labelled & (draft == at(ids, index))
        valid = counted & valid_slots(prefix_ok, match)
        where = valid.nonzero(as_tuple=True)
        # Shape: (M, H) -> (M, V) the differentiable heads of the valid slots
        normed_valid = normed[where]
        logits = self.target.lm_head(normed_valid)
        teacher_ids, teacher_lp = teacher_ids[where], teacher_lp[where]
        rank_target = rank_class(token_rank(logits.detach(), teacher_ids[:, 0]), self.drafter.rank_class_bounds)
        return BlockResult(
            hidden=hidden,
            draft=draft,
            counted=counted,
            valid=valid,
            through=correct_through(prefix_ok, match),
            start=start,
            slot=where[2],
            logits=logits,
            rank_logits=self.drafter.rank_logits(normed_valid, torch.log_softmax(logits.float(), dim=-1)),
            rank_target=rank_target,
            teacher_ids=teacher_ids,
            teacher_lp=teacher_lp,
        )

    def unroll(self, batch: dict[str, torch.Tensor]) -> list[BlockResult]:
        """The context blocks of every position, then ``num_blocks - 1`` launched blocks per anchor."""
        batch = with_features(batch, self.target, self.topk)
        drafter = self.drafter
        ids, doc, positions = batch["input_ids"], batch["doc_ids"], batch["position_ids"]
        b, t = ids.shape
        k = drafter.block_size
        dtype = drafter.fuse.weight.dtype
        embed = self.target.embed_tokens
        generator = anchor_generator(self.seed, self.global_step if self.training else None)
        cache = DynamicCache(config=drafter.config)

        rows = torch.arange(t, device=ids.device).expand(b, t)
        hidden = drafter(
            drafter.project_features(batch["features"].to(dtype)),
            embed(ids).to(dtype),
            positions,
            context_mask(doc, k)[:, None],
            cache,
        )
        live = doc > 0
        results = [self._score(batch, hidden, rows, rows, live, live)]
        if self.num_blocks == 1:
            return results

        anchors, anchor_ok = sample_anchors(batch["loss_mask"], doc, self.max_anchors, generator)
        a = anchors.clamp(min=0)
        n = a.shape[1]
        pick = lambda x: x[torch.arange(b, device=ids.device)[:, None], a]  # noqa: E731
        # The block launches start from: hidden (B, A, K, H), drafts and chain state (B, A, K), token rows (B, A)
        prev_hidden, prev_draft, prev_start = pick(results[0].hidden), pick(results[0].draft), a
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
            j = choose_launch_slots(prev_through, generator)
            visible = visible | torch.zeros_like(visible).scatter(2, prev_keys, slot <= j[..., None])
            condition = prev_hidden.gather(2, j[..., None, None].expand(-1, -1, 1, prev_hidden.shape[-1])).squeeze(2)
            token = prev_draft.gather(2, j[..., None]).squeeze(2)
            prefix_ok = prev_through.gather(2, j[..., None]).squeeze(2)
            start = prev_start + 1 + j
            cached = cache.get_seq_length(0)
            hidden = drafter(
                condition,
                embed(token).to(dtype),
                pick(positions) + (start - a),
                launch_mask(visible, k),
                cache,
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
        """Per (block, slot) means of per-valid-slot ``values`` (M,) each, and which (block, slot) have any valid
        slot. Shape: (n_blocks, K) × 2."""
        k = self.drafter.block_size
        means, present = [], []
        for v, r in zip(values, results, strict=True):
            count = torch.bincount(r.slot, minlength=k)
            total = torch.zeros(k, dtype=v.dtype, device=v.device).index_add(0, r.slot, v)
            means.append(total / count.clamp(min=1))
            present.append(count > 0)
        return torch.stack(means), torch.stack(present)

    def losses(self, results: list[BlockResult]) -> dict[str, torch.Tensor]:
        kl = [forward_kl_topk(r.logits, r.teacher_ids, r.teacher_lp) for r in results]
        num_classes = results[0].rank_logits.shape[-1]
        rank = [
            -(
                ordinal_targets(r.rank_target, num_classes, self.rank_smoothing) * r.rank_logits.float().log_softmax(-1)
            ).sum(-1)
            for r in results
        ]
        kl_means, present = self._slot_means(kl, results)
        rank_means, _ = self._slot_means(rank, results)
        p = present.float()
        # Shape: (K,) the mean over blocks of each slot's mean KL
        kl_per_slot = (kl_means * p).sum(0) / p.sum(0).clamp(min=1)
        decay = self.slot_decay ** torch.arange(kl_per_slot.shape[0], device=kl_per_slot.device, dtype=torch.float32)
        kl_loss = (decay * kl_per_slot).sum()
        rank_loss = (rank_means * p).sum() / p.sum().clamp(min=1)
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
        argmax, TVD to the target, rank-head accuracy."""
        k = self.drafter.block_size
        per_slot = lambda v, r: torch.zeros(k, device=v.device).index_add(0, r.slot, v.float())  # noqa: E731
        stats: dict[str, list[torch.Tensor]] = {"counted": [], "valid": [], "top1": [], "tvd": [], "rank_acc": []}
        for r in results:
            stats["counted"].append(r.counted.float().sum(dim=(0, 1)))
            stats["valid"].append(r.valid.float().sum(dim=(0, 1)))
            stats["top1"].append(per_slot(r.logits.argmax(-1) == r.teacher_ids[:, 0], r))
            stats["tvd"].append(per_slot(tvd_topk(r.logits, r.teacher_ids, r.teacher_lp), r))
            stats["rank_acc"].append(per_slot(r.rank_logits.argmax(-1) == r.rank_target, r))
        # Shape: (n_blocks, K) per stat
        self.val_sums.add({key: torch.stack(values) for key, values in stats.items()})

    def depth_table(self) -> dict[str, list[list[float]]]:
        """``{stat: [[value at slot 0..K-1] per block]}``: valid is the share of counted slots (labelled, under
        the loss mask) whose chain was correct before them; top1, tvd and rank_acc are means over valid slots."""
        if not self.val_sums:
            return {}
        out = {"valid": self.val_sums.mean("valid", "counted").tolist(), "count": self.val_sums["valid"].tolist()}
        for stat in ("top1", "tvd", "rank_acc"):
            out[stat] = self.val_sums.mean(stat, "valid").tolist()
        return out

    def validation_metrics(self) -> dict[str, float]:
        table = self.depth_table()
        return {
            f"val_depth/{stat}/b{block + 1}s{slot}": value
            for stat in ("valid", "top1", "tvd", "rank_acc")
            for block, row in enumerate(table.get(stat, []))
            for slot, value in enumerate(row)
            if table["count"][block][slot] > 0
        }

    def print_table(self) -> None:
        """Per (block, slot): share of valid slots, top-1 agreement, TVD and rank-head accuracy."""
        table = self.depth_table()
        if not table:
            return
        show_table(
            "SpecBlock per (block, slot) on validation: valid = chain correct before the slot",
            ["block", "slot", "valid", "top1", "tvd", "rank acc", "n valid"],
            [
                [
                    str(block + 1),
                    str(slot),
                    *[f"{table[stat][block][slot]:.3f}" for stat in ("valid", "top1", "tvd", "rank_acc")],
                    str(int(count)),
                ]
                for block, counts in enumerate(table["count"])
                for slot, count in enumerate(counts)
            ],
        )
