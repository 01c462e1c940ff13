"""``--format sglang``: SGLang's EAGLE-3 draft directory (``LlamaForCausalLMEagle3``; ALGORITHMS.md §6).

``config.json`` is a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
``draft_vocab_size``, ``tie_word_embeddings: false``, ``eagle_config.eagle_aux_hidden_state_layer_ids`` in
SGLang's convention (:func:`trainer.drafters.eagle3.sglang_layer_ids`: the 0-based ids of the target layers whose
outputs the drafter was trained on, one lower than vLLM's HF ``hidden_states`` indices in the ``speculators``
layout) and the legacy ``rope_theta`` for engines on transformers 4.x. Weights: ``midlayer.*``
(q/k/v read ``2H``), ``fc`` ``[H, 3H]``, ``norm``, ``lm_head`` ``[draft_vocab, H]``, ``d2t`` (draft id →
target id offset; SGLang's hot-token map is ``d2t + arange``) and ``t2d``. No embedding: SGLang shares the
target's. This is the drafter's own save format; the export only converts the dtype and writes atomically.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

ACCEPTS = ("eagle3",)


def write(drafter: PreTrainedModel, out: Path, verifier: str | None) -> None:
    drafter.save_pretrained(out)
