"""``--format specblock``: a SpecBlock drafter as an HF directory, which our engine and vLLM (through this project's
plugin) both serve.

``config.json`` is a Qwen3 config with ``architectures: ["SpecBlockDraftModel"]``, ``num_target_layers`` and
``specblock_config: {block_size, target_layer_ids, rank_class_bounds, rank_hidden_size, alignment,
draft_vocab_size}`` (with a draft vocabulary also ``lm_head``, ``d2t``, ``t2d``); the weights are the
drafter's parameter names (:mod:`trainer.drafters.specblock`). The loading class is
``trainer.drafters.specblock.SpecBlockDraftModel.from_pretrained(DIR)`` (or ``trainer.drafters.load_drafter``),
and ``trainer eval --drafter DIR --tree specblock`` runs it.

For vLLM the config also holds ``eagle_aux_hidden_state_layer_ids``: the target layers in vLLM's convention
(:func:`trainer.export.speculators.vllm_aux_layer_ids`), which vLLM's EAGLE-3 route captures as auxiliary hidden
states; with the plugin installed, ``vllm serve TARGET --no-enable-prefix-caching --speculative-config
'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": N}'`` drafts SpecBlock's chain
(:mod:`trainer.integrations.vllm.specblock`).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedModel

from trainer.export.speculators import vllm_aux_layer_ids

ACCEPTS = ("specblock",)


def write(drafter: PreTrainedModel, out: Path, verifier: str | None) -> None:
    drafter.save_pretrained(out)
    config_file = Path(out) / "config.json"
    config = json.loads(config_file.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = vllm_aux_layer_ids(drafter.target_layer_ids)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
