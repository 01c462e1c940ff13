"""Lightning callbacks the recipes list under ``trainer.callbacks``.

``GradientCheckpointing`` recomputes each drafter decoder layer's activations in the backward pass instead of
keeping them: a GPU recipe with hundreds of anchors per row (DFlash's 512 blocks of 16 slots over several layers)
trades one extra drafter forward for most of its activation memory. The frozen target runs without gradients and
keeps no activations either way. A layer's KV-cache writes (SpecBlock's unroll reads the context blocks' keys from
a cache) happen once, outside the recomputed part (:class:`trainer.drafters.common.DrafterDecoderLayer`), so the
recomputation sees the keys its forward saw. In a recipe::

    callbacks:
      - class_path: trainer.callbacks.GradientCheckpointing
"""

from __future__ import annotations

import lightning as L

from trainer.errors import UserError


class GradientCheckpointing(L.Callback):
    """Turn on HF gradient checkpointing of the drafter (the decoder layers that carry a ``gradient_checkpointing``
    flag: HF's ``GradientCheckpointingLayer`` s and the drafters' ``DrafterDecoderLayer``)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        drafter = pl_module.drafter
        if not getattr(drafter, "supports_gradient_checkpointing", False):
            raise UserError(f"{type(drafter).__name__} does not support gradient checkpointing; drop the callback")
        drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
