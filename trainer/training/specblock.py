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

from dataclasses import fields
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from trainer.data.features import with_features
from trainer.drafters.specblock import SpecBlockDraftModel, build_config
from trainer.errors import UserError
from trainer.training.frozen_target import FrozenTargetTraining, show_table
from trainer.training.specblock_losses import (
    BlockResult,
    SpecBlockLoss,
    SpecBlockOptions,
    rank_loss,
    specblock_losses,
    specblock_unroll,
)


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

    # ---- the loss -----------------------------------------------------------------------------------------
    @property
    def loss_options(self) -> SpecBlockOptions:
        """The loss options, read from the module's attributes at each call."""
        return SpecBlockOptions(**{f.name: getattr(self, f.name) for f in fields(SpecBlockOptions)})

    def unroll(self, batch: dict[str, torch.Tensor]) -> list[BlockResult]:
        step = self.global_step if self.training else None
        return specblock_unroll(
            self.drafter, self.target, with_features(batch, self.target, self.topk), self.loss_options, step
        )

    def rank_loss(self, r: BlockResult) -> torch.Tensor:
        return rank_loss(r, self.loss_options, self.drafter.block_size)

    def losses(self, results: list[BlockResult]) -> SpecBlockLoss:
        return specblock_losses(results, self.loss_options, self.drafter.block_size)

    def training_step(self, batch, batch_idx):
        out = self.losses(self.unroll(batch))
        self.log("train/loss", out.loss, prog_bar=True)
        self.log("train/kl", out.kl)
        self.log("train/rank", out.rank)
        self.log("train/valid_fraction", out.valid_fraction)
        return out.loss

    def validation_step(self, batch, batch_idx):
        results = self.unroll(batch)
        out = self.losses(results)
        self.log("val/loss", out.loss, prog_bar=True, sync_dist=True)
        self.log("val/kl", out.kl, sync_dist=True)
        self.log("val/rank", out.rank, sync_dist=True)
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
            # float32 whatever the default dtype (bf16-true validation makes it bfloat16).
            zeros = torch.zeros(k, device=r.slot.device, dtype=torch.float32)
            per_slot = lambda v: zeros.index_add(0, r.slot, v.float() * r.kl_mask)  # noqa: E731, B023
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
