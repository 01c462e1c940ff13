"""What DFlash and TreeFlash training share beyond the frozen target: block batches, the block forward, metrics.

A subclass builds its drafter in ``build_drafter`` and defines the steps and its ``depth_names``; the block
forward runs the family's core (``trainer.drafters.families``: the DFlash drafter, or TreeFlash's backbone).
The target runs inside the step when the batch comes without features (online) and is skipped when the batch
was read from a feature cache (offline); its embedding and LM head are used either way.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.families import family_of
from trainer.losses import forward_kl_topk, topk_coverage, tvd_topk
from trainer.training.blocks import Blocks, block_batch, slot_weights
from trainer.training.frozen_target import FrozenTargetTraining, show_table


class BlockDrafterTraining(FrozenTargetTraining):
    """Base of block-drafter LightningModules.

    Args:
        gamma: depth decay of the slot weights, ``w_k = exp(-(k-1)/gamma)``.
        max_anchors: blocks per training row.
        seed: anchor sampling seed (draws are a function of seed and step, so a resumed run draws the same).

    The other arguments: see :class:`~trainer.training.frozen_target.FrozenTargetTraining`.
    """

    def __init__(self, gamma: float = 7.0, max_anchors: int = 32, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gamma = gamma
        self.max_anchors = max_anchors
        self.seed = seed

    @property
    def dflash(self) -> DFlashDraftModel:
        """The module with the DFlash forward signature: the family's core (a DFlash drafter, TreeFlash's backbone)."""
        return family_of(self.drafter).core(self.drafter)

    def fit_problems(self, target: PretrainedConfig) -> list[str]:
        problems = super().fit_problems(target)
        mask = self.dflash.mask_token_id
        if mask is None or not 0 <= mask < target.vocab_size:
            problems.append(f"mask token id {mask} outside the target's vocabulary of {target.vocab_size}")
        return problems

    # ---- batches ------------------------------------------------------------------------------------------
    def _blocks(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Blocks]:
        step = self.global_step if self.training else None
        return block_batch(self.dflash, self.target, batch, self.topk, self.max_anchors, self.seed, step)

    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(normed_hidden)

    def slot_weights(self) -> torch.Tensor:
        return slot_weights(self.dflash.block_size, self.gamma, device=self.device)

    # ---- metrics ------------------------------------------------------------------------------------------
    # The distributions whose per-depth metrics are tracked, in table order.
    depth_names: tuple[str, ...] = ()

    def accumulate_depth_metrics(self, name: str, logits: torch.Tensor, blocks: Blocks, t_ids, t_lp) -> None:
        """Sum per-depth KL, TVD and top-1/top-5 coverage of the target's top token over valid slots."""
        m = blocks.label_mask.float()
        target_token = t_ids[..., 0]
        stats = {
            "kl": forward_kl_topk(logits, t_ids, t_lp),
            "tvd": tvd_topk(logits, t_ids, t_lp),
            "top1": topk_coverage(logits, target_token, 1),
            "top5": topk_coverage(logits, target_token, 5),
            "count": torch.ones_like(m),
        }
        # Shape: (K,) sums over blocks of the valid slots
        self.val_sums.add({f"{name}/{stat}": (value * m).sum(dim=(0, 1)) for stat, value in stats.items()})

    def depth_table(self) -> dict[str, list[float]]:
        """Per-depth means ``{name/stat: [value at depth 0..K-1]}`` plus ``{name/count: [...]}``."""
        out = {}
        for key in self.val_sums.sums:
            name, stat = key.split("/")
            out[key] = (self.val_sums[key] if stat == "count" else self.val_sums.mean(key, f"{name}/count")).tolist()
        return out

    def validation_metrics(self) -> dict[str, float]:
        out = {}
        for key, values in self.depth_table().items():
            name, stat = key.split("/")
            if stat == "count":
                continue
            counts = self.val_sums[f"{name}/count"]
            for depth, value in enumerate(values):
                if depth > 0 and counts[depth] > 0:
                    out[f"val_depth/{key}/d{depth:02d}"] = value
        return out

    def print_table(self) -> None:
        """Per-depth TVD and top-1/top-5 coverage of every tracked distribution."""
        table = self.depth_table()
        if not table:
            return
        names, stats = self.depth_names, ("tvd", "top1", "top5")
        counts = table[f"{names[0]}/count"]
        show_table(
            "per-depth distance to the target (validation)",
            ["depth", *[f"{name} {stat}" for name in names for stat in stats]],
            [
                [str(depth), *[f"{table[f'{n}/{s}'][depth]:.3f}" for n in names for s in stats]]
                for depth in range(1, len(counts))
                if counts[depth] > 0
            ],
        )
