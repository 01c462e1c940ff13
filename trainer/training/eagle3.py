"""EAGLE-3 training with training-time test (docs/algorithms.md §6): the drafter is unrolled on its own outputs.

Step 0 gives position ``t`` the fused target feature ``fc(f_t)`` and the embedding of ``x_{t+1}`` and trains it
to predict ``x_{t+2}``. Step ``i`` gives position ``t`` the drafter's own pre-norm output of step ``i-1`` at
``t`` and the embedding of ``x_{t+1+i}``, and trains it to predict ``x_{t+2+i}``: position ``t`` of step ``i``
is the ``i``-th drafted token of a chain that started after ``x_{t+1}``, exactly what the drafter computes at
inference when it drafts ``i`` tokens ahead of a committed prefix (with ground-truth tokens as its inputs).

Attention (the training-time test): the query of step ``i`` at ``t`` sees the step-0 keys of positions
``s <= t`` of its own packed sample - the committed prefix, whose keys come from true target features - and the
keys of steps ``1..i`` at the same position ``t`` - its own chain of drafted ancestors - and nothing else.
That is the key set a node at depth ``i`` of a draft tree sees at inference, where the drafted keys of other
positions do not exist (the committed prefix is re-run on target features after every verification). Its
RoPE position is ``position_ids[t] + i``, the position the drafted token has at inference. The unroll runs
through the drafter's public ``forward`` with a KV cache that holds the keys of the earlier steps, so training
and tree drafting share one code path.

Loss: ``Σ_i decay^i · CE_i``, ``CE_i`` the mean over valid positions of ``-Σ_v p_T(v) log q(v)``, ``q`` the
drafter's distribution over the draft vocabulary and ``p_T`` the target's top-k distribution at ``t+1+i``
restricted to the draft vocabulary and renormalised there. A position is valid when its label is in the same
sample, under the loss mask, and the target's top token is in the draft vocabulary (otherwise the restricted
teacher says nothing about the token the target will actually choose). The draft vocabulary is the
``draft_vocab_size`` most frequent loss-masked tokens of the training rows (``trainer.drafters.vocab``).

On CPU with the shipped tiny target::

    trainer fit --recipe eagle3_tiny
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from trainer.data.features import with_features
from trainer.drafters.eagle3 import Eagle3DraftModel, build_config
from trainer.errors import UserError
from trainer.losses import topk_coverage
from trainer.training.eagle3_losses import TTTStep, eagle3_loss, eagle3_unroll
from trainer.training.frozen_target import FrozenTargetTraining, show_table


class Eagle3Training(FrozenTargetTraining):
    """Trains an EAGLE-3 drafter against a frozen target with the training-time-test unroll.

    Args:
        target: HF causal LM (directory or hub id); its input embedding feeds the drafter.
        draft_vocab_size: size of the drafter's output vocabulary (most frequent loss-masked training tokens).
        ttt_steps: unrolled steps; step ``i`` trains the ``i``-th drafted token after a committed prefix.
        step_decay: loss weight ``step_decay^i`` of step ``i``.
        intermediate_size: the drafter's MLP width; default the target's.
        init_lm_head: start ``lm_head`` from the target's LM-head rows of the draft vocabulary.
        init_from: continue from this EAGLE-3 HF directory (its draft vocabulary is kept).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices.
        warmup_steps: linear warm-up steps.

    The end of fit writes the drafter to ``export_dir`` in SGLang's ``LlamaForCausalLMEagle3`` layout. The other
    arguments: see :class:`~trainer.training.frozen_target.FrozenTargetTraining`.
    """

    def __init__(
        self,
        target: str,
        draft_vocab_size: int = 32000,
        ttt_steps: int = 7,
        step_decay: float = 0.8,
        intermediate_size: int | None = None,
        init_lm_head: bool = True,
        init_from: str | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
        **kwargs: Any,
    ) -> None:
        if ttt_steps < 1:
            raise UserError(f"model.ttt_steps must be at least 1, got {ttt_steps}")
        super().__init__(target=target, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, **kwargs)
        self.draft_vocab_size = draft_vocab_size
        self.ttt_steps = ttt_steps
        self.step_decay = step_decay
        self.intermediate_size = intermediate_size
        self.init_lm_head = init_lm_head
        self.init_from = init_from

    family = "EAGLE-3"

    # ---- model --------------------------------------------------------------------------------------------
    def build_drafter(self, target: PreTrainedModel) -> Eagle3DraftModel:
        if self.init_from:
            return self.load_drafter(Eagle3DraftModel, self.init_from)
        overrides = {"intermediate_size": self.intermediate_size} if self.intermediate_size else {}
        drafter = Eagle3DraftModel(build_config(target.config, self.draft_vocab_size, **overrides))
        self.adopt_training_vocab(drafter, target, self.init_lm_head)
        return drafter

    def fit_problems(self, target: PretrainedConfig) -> list[str]:
        problems = super().fit_problems(target)
        if self.drafter.config.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.drafter.config.vocab_size} vs the target's {target.vocab_size}")
        return problems

    # ---- the unroll ---------------------------------------------------------------------------------------
    def unroll(self, batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[TTTStep]]:
        """Pre-norm drafter outputs (B, T, H) and the step description of every unrolled step."""
        return eagle3_unroll(self.drafter, self.target, batch, self.ttt_steps)

    def _forward(self, batch: dict[str, torch.Tensor]):
        """The weighted loss and, per step: draft logits, step, teacher top-k, restricted teacher, loss mask."""
        return eagle3_loss(
            self.drafter, self.target, with_features(batch, self.target, self.topk), self.ttt_steps, self.step_decay
        )

    # ---- steps --------------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        loss, per_step = self._forward(batch)
        self.log("train/loss", loss, prog_bar=True)
        with torch.no_grad():
            logits, step, t_ids, _, _ = per_step[0]
            hit = (self.drafter.to_target(logits.argmax(-1)) == t_ids[..., 0])[step.label_mask]
            self.log("train/top1_s0", hit.float().mean() if hit.numel() else torch.zeros(()), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, per_step = self._forward(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        vocab = self.drafter.draft_vocab
        sums: dict[str, list[torch.Tensor]] = {"top1": [], "top5": [], "count": [], "kl": [], "kl_count": []}
        for logits, step, t_ids, kl, mask in per_step:
            valid = step.label_mask.float()
            top = t_ids[..., 0]
            # The target's top token as a draft id, or -1 (never predicted) when it has none.
            top_draft = torch.where(vocab.t2d[top], vocab.to_draft(top), -1)
            sums["top1"].append(((self.drafter.to_target(logits.argmax(-1)) == top).float() * valid).sum())
            sums["top5"].append((topk_coverage(logits, top_draft, 5) * valid).sum())
            sums["count"].append(valid.sum())
            sums["kl"].append((kl * mask.float()).sum())
            sums["kl_count"].append(mask.float().sum())
        # Shape: (S,) sums over the batch, one entry per unrolled step
        self.val_sums.add({key: torch.stack(values) for key, values in sums.items()})

    # ---- per-step metrics ---------------------------------------------------------------------------------
    def step_table(self) -> dict[str, list[float]]:
        """Per-step means ``{top1, top5, kl: [value at step 0..S-1]}`` plus the position counts."""
        if not self.val_sums:
            return {}
        sums = self.val_sums
        return {
            "top1": sums.mean("top1", "count").tolist(),
            "top5": sums.mean("top5", "count").tolist(),
            "kl": sums.mean("kl", "kl_count").tolist(),
            "count": sums["count"].tolist(),
        }

    def validation_metrics(self) -> dict[str, float]:
        table = self.step_table()
        stats = ("top1", "top5", "kl")
        return {f"val_step/{stat}/s{i}": value for stat in stats for i, value in enumerate(table.get(stat, []))}

    def print_table(self) -> None:
        """Per unrolled step: top-1/top-5 agreement with the target and KL to it."""
        table = self.step_table()
        if not table:
            return
        show_table(
            "per-step agreement with the target (validation, teacher-forced inputs)",
            ["step", "predicts", "top1", "top5", "kl", "positions"],
            [
                [
                    str(i),
                    f"x(t+{i + 2})",  # round brackets: rich reads square ones as markup
                    f"{table['top1'][i]:.3f}",
                    f"{table['top5'][i]:.3f}",
                    f"{table['kl'][i]:.3f}",
                    str(int(count)),
                ]
                for i, count in enumerate(table["count"])
            ],
        )
