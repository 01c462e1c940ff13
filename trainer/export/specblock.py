"""``--format specblock``: a SpecBlock drafter as an HF directory (no inference engine has a SpecBlock format).

``config.json`` is a Qwen3 config with ``architectures: ["SpecBlockDraftModel"]``, ``num_target_layers`` and
``specblock_config: {block_size, target_layer_ids, rank_class_bounds, rank_hidden_size, alignment,
draft_vocab_size}`` (with a draft vocabulary also ``lm_head``, ``d2t``, ``t2d``); the weights are the
drafter's parameter names (:mod:`trainer.drafters.specblock`). The loading class is
``trainer.drafters.specblock.SpecBlockDraftModel.from_pretrained(DIR)`` (or ``trainer.drafters.load_drafter``),
and ``trainer eval --drafter DIR --tree specblock`` runs it.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

ACCEPTS = ("specblock",)


def write(drafter: PreTrainedModel, out: Path, verifier: str | None) -> None:
    drafter.save_pretrained(out)
