"""What DFlash and TreeFlash training share beyond the frozen target: block batches, the block forward, metrics.

A subclass builds its drafter in ``build_drafter`` and defines the steps and its ``depth_names``. The
target runs inside the step when the batch comes without features (online) and is skipped when the batch
was read from a feature cache (offline); its embedding and LM head are used either way.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from rich.console import Console
from rich.table import Table
from transformers import PretrainedConfig

from trainer.data.features import with_features
from trainer.losses import forward_kl_topk, topk_coverage, tvd_topk
from trainer.training.blocks import Blocks, block_attention_mask, make_blocks, sample_anchors, slot_weights
from trainer.training.frozen_target import FrozenTargetTraining


class BlockDrafterTraining(FrozenTargetTraining):
    """Base of block-drafter LightningModules (see the subclasses for the recipe arguments)."""

    def __init__(self) -> None:
        # Subclasses call save_hyperparameters(); every argument below is read from self.hparams.
        super().__init__()
        self._depth_sums: dict[str, torch.Tensor] = {}

    @property
    @abstractmethod
    def dflash(self) -> torch.nn.Module:
        """The module with the DFlash forward signature (the drafter itself, or its backbone)."""

    def fit_problems(self, target: PretrainedConfig) -> list[str]:
        problems = super().fit_problems(target)
        mask = self.dflash.mask_token_id
        if mask is None or not 0 <= mask < target.vocab_size:
            problems.append(f"mask token id {mask} outside the target's vocabulary of {target.vocab_size}")
        return problems

    # ---- batches ------------------------------------------------------------------------------------------
    def _blocks(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Blocks]:
        batch = with_features(batch, self.target, self.hparams.topk)
        generator = torch.Generator().manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
        if not self.training:
            generator.manual_seed(self.hparams.seed)
        anchors, valid = sample_anchors(batch["loss_mask"], batch["doc_ids"], self.hparams.max_anchors, generator)
        blocks = make_blocks(
            batch["input_ids"],
            batch["loss_mask"],
            batch["position_ids"],
            batch["doc_ids"],
            anchors,
            valid,
            self.dflash.block_size,
            self.dflash.mask_token_id,
        )
        return batch, blocks

    def block_hidden(self, batch: dict[str, torch.Tensor], blocks: Blocks) -> torch.Tensor:
        """The drafter's pre-norm hidden states of every block slot. Shape: (B, N, K, H)"""
        b, n, k = blocks.tokens.shape
        dtype = self.dflash.fc.weight.dtype
        noise = self.target.embed_tokens(blocks.tokens.flatten(1)).to(dtype)
        positions = torch.cat([batch["position_ids"], blocks.positions.flatten(1)], dim=1)
        mask = block_attention_mask(batch["doc_ids"], blocks, dtype=dtype)
        hidden = self.dflash(
            noise_embedding=noise,
            target_hidden=batch["features"].to(dtype),
            position_ids=positions,
            attention_mask=mask,
            return_prenorm=True,
        )
        return hidden.view(b, n, k, -1)

    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(normed_hidden)

    @staticmethod
    def teacher(batch: dict[str, torch.Tensor], blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher top-k ids and log-probs for every slot (target distribution at a+k-1). Shape: (B, N, K, k)"""
        idx = blocks.teacher_index.flatten(1)[..., None]
        ids, lp = batch["teacher_topk_ids"], batch["teacher_topk_logprobs"]
        k = ids.shape[-1]
        gather = lambda x: x.gather(1, idx.expand(-1, -1, k)).view(*blocks.teacher_index.shape, k)  # noqa: E731
        return gather(ids), gather(lp)

    def slot_weights(self) -> torch.Tensor:
        return slot_weights(self.dflash.block_size, self.hparams.gamma, device=self.device)

    # ---- metrics ------------------------------------------------------------------------------------------
    def accumulate_depth_metrics(self, name: str, logits: torch.Tensor, blocks: Blocks, t_ids, t_lp) -> None:
        """Sum per-depth KL, TVD and top-1/top-5 coverage of the target's top token over valid slots."""
        m = blocks.label_mask.float()
        target_token = t_ids[..., 0]
        stats = {
            "kl": forward_kl_topk(logits, t_ids, t_lp),
            "tvd": tvd_topk(logits, t_ids, t_lp),
            "top1": topk_coverage(logits, target_token, 1),
            "top5": topk_coverage(logits, target_token, 5),
        }
        for stat, value in stats.items():
            key = f"{name}/{stat}"
            # Shape: (K,) sums over blocks
            total = (value * m).sum(dim=(0, 1)).detach().cpu()
            self._depth_sums[key] = self._depth_sums.get(key, 0) + total
        count = f"{name}/count"
        self._depth_sums[count] = self._depth_sums.get(count, 0) + m.sum(dim=(0, 1)).detach().cpu()

    def on_validation_epoch_start(self) -> None:
        self._depth_sums = {}

    def depth_table(self) -> dict[str, list[float]]:
        """Per-depth means ``{name/stat: [value at depth 0..K-1]}`` plus ``{name/count: [...]}``."""
        out = {}
        for key, total in self._depth_sums.items():
            name, stat = key.split("/")
            count = self._depth_sums[f"{name}/count"]
            out[key] = total.tolist() if stat == "count" else (total / count.clamp(min=1)).tolist()
        return out

    def on_validation_epoch_end(self) -> None:
        for key, values in self.depth_table().items():
            name, stat = key.split("/")
            if stat == "count":
                continue
            counts = self._depth_sums[f"{name}/count"]
            for depth, value in enumerate(values):
                if depth > 0 and counts[depth] > 0:
                    self.log(f"val_depth/{key}/d{depth:02d}", value, sync_dist=True)
        if self.trainer.state.fn == "validate" and self.trainer.is_global_zero:
            self.print_table()

    # The distributions whose per-depth metrics are tracked, in table order.
    depth_names: tuple[str, ...] = ()

    def print_table(self) -> None:
        """Per-depth TVD and top-1/top-5 coverage of every tracked distribution."""
        names = self.depth_names
        table = self.depth_table()
        if not table:
            return
        t = Table(title="per-depth distance to the target (validation)")
        t.add_column("depth")
        for name in names:
            for stat in ("tvd", "top1", "top5"):
                t.add_column(f"{name} {stat}")
        counts = table[f"{names[0]}/count"]
        for depth in range(1, len(counts)):
            if counts[depth] == 0:
                continue
            t.add_row(str(depth), *[f"{table[f'{n}/{s}'][depth]:.3f}" for n in names for s in ("tvd", "top1", "top5")])
        Console().print(t)
