"""What DFlash and TreeFlash training share: the frozen target, block batches, the block forward, metrics.

A subclass builds its drafter in ``build_drafter`` and defines ``training_loss`` / ``depth_metrics``. The
target runs inside the step when the batch comes without features (online) and is skipped when the batch
was read from a feature cache (offline); its embedding and LM head are used either way.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

import lightning as L
import torch
from rich.console import Console
from rich.table import Table
from transformers import PretrainedConfig

from trainer.data.features import with_features
from trainer.errors import UserError
from trainer.export_util import save_hf_dir
from trainer.losses import forward_kl_topk, topk_coverage, tvd_topk
from trainer.optim import adamw_warmup_cosine
from trainer.paths import project_path
from trainer.target import Target, load_causal_lm
from trainer.training.blocks import Blocks, block_attention_mask, make_blocks, sample_anchors, slot_weights


def check_drafter_fits(drafter: PretrainedConfig, target: PretrainedConfig, target_name: str) -> None:
    """A drafter made for another target fails here with what differs, not deep inside a forward."""
    dflash = drafter.dflash_config or {}
    problems = []
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden size {drafter.hidden_size} vs the target's {target.hidden_size}")
    layer_ids = dflash.get("target_layer_ids") or []
    if layer_ids and max(layer_ids) >= target.num_hidden_layers:
        problems.append(f"target layer ids {layer_ids} but the target has {target.num_hidden_layers} layers")
    mask = dflash.get("mask_token_id")
    if mask is None or not 0 <= mask < target.vocab_size:
        problems.append(f"mask token id {mask} outside the target's vocabulary of {target.vocab_size}")
    if problems:
        raise UserError(f"the drafter does not fit the target '{target_name}': " + "; ".join(problems))


class BlockDrafterTraining(L.LightningModule):
    """Base of block-drafter LightningModules (see the subclasses for the recipe arguments)."""

    def __init__(self) -> None:
        # Subclasses call save_hyperparameters(); every argument below is read from self.hparams.
        super().__init__()
        self.target: Target | None = None
        self.drafter: torch.nn.Module | None = None
        self._depth_sums: dict[str, torch.Tensor] = {}

    # ---- model --------------------------------------------------------------------------------------------
    @abstractmethod
    def build_drafter(self, target_config: PretrainedConfig) -> torch.nn.Module:
        """The family's drafter for a target of ``target_config`` (new, or loaded from the recipe's checkpoint)."""

    def configure_model(self) -> None:
        if self.drafter is not None:
            return
        model = load_causal_lm(str(project_path(self.hparams.target)), self.hparams.target_dtype)
        self.drafter = self.build_drafter(model.config)
        check_drafter_fits(self.dflash.config, model.config, self.hparams.target)
        self.target = Target(model, self.layer_ids)

    @property
    @abstractmethod
    def layer_ids(self) -> list[int]:
        """Target layer ids the drafter reads (HF ``hidden_states[l + 1]``)."""

    @property
    @abstractmethod
    def dflash(self) -> torch.nn.Module:
        """The module with the DFlash forward signature (the drafter itself, or its backbone)."""

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
            self.print_depth_table()

    # The distributions whose per-depth metrics are tracked, in table order.
    depth_names: tuple[str, ...] = ()

    def print_depth_table(self) -> None:
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

    # ---- optimisation ---------------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def configure_optimizers(self):
        params = self.trainable_parameters()
        if not params:
            raise UserError("nothing to train: every drafter parameter is frozen")
        hp = self.hparams
        return adamw_warmup_cosine(
            params, hp.lr, hp.weight_decay, hp.warmup_steps, self.trainer.estimated_stepping_batches, hp.min_lr_ratio
        )

    def state_dict(self, *args, **kwargs):
        # The frozen target is rebuilt from its path; checkpoints hold the drafter only.
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("target.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in missing if not k.startswith("target.")]
        if strict and (missing or unexpected):
            raise RuntimeError(f"checkpoint does not match the drafter: missing {missing}, unexpected {unexpected}")
        return missing, unexpected

    def export(self, model: torch.nn.Module) -> Path:
        """Write the drafter as an HF directory (``export_dir`` or ``<run>/hf``)."""
        out = Path(self.hparams.export_dir or Path(self.trainer.log_dir or ".") / "hf")
        save_hf_dir(out, model.save_pretrained)
        return out

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        cache = getattr(datamodule, "feature_cache", None)
        if cache is not None and cache.manifest["config"]["layers"] != self.layer_ids:
            raise UserError(
                f"the feature cache {cache.root} holds target layers {cache.manifest['config']['layers']}, "
                f"the drafter reads {self.layer_ids}; rebuild it with trainer data cache --layers '{self.layer_ids}'"
            )
