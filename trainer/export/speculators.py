"""``--format speculators``: vLLM's speculators format for DFlash and EAGLE-3 drafters (schema of speculators 0.9).

``config.json`` holds ``speculators_model_type`` (``dflash`` / ``eagle3``), ``architectures``
(``DFlashSpeculator`` / ``Eagle3Speculator``), ``speculators_config: {algorithm, proposal_methods,
default_proposal_method, verifier: {name_or_path, architectures}}``, the decoder layers' own HF config as
``transformer_layer_config`` and the algorithm's fields:

- DFlash: ``block_size``, ``mask_token_id``, ``draft_vocab_size`` (the target's: DFlash drafts over the full
  vocabulary), ``aux_hidden_state_layer_ids`` in vLLM's convention (:func:`vllm_aux_layer_ids`: HF
  ``hidden_states`` indices, our layer ids + 1; vLLM also feeds the target's last layer on its own, so that one
  may not be among them). Weights as in the reference layout: ``layers.{i}.*``, ``fc``, ``hidden_norm``,
  ``norm``; the embedding and LM head are the verifier's.
- EAGLE-3: ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention, as for DFlash; the
  ``sglang`` layout writes the same key one lower, :func:`trainer.drafters.eagle3.sglang_layer_ids`),
  ``norm_before_residual: false`` (the residual is the raw hidden state). Weights: ``midlayer.*`` renamed
  ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, and ``d2t`` / ``t2d`` when the draft vocabulary is reduced.

The verifier (``--target``, or the run's recipe) is recorded by path or hub id; vLLM serves its own target and
reads the drafter from the directory: ``vllm serve TARGET --speculative-config '{"model": "DIR", ...}'``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen3Config

from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.eagle3 import ARCHITECTURE as EAGLE3_ARCHITECTURE
from trainer.drafters.eagle3 import Eagle3DraftModel, sglang_layer_ids
from trainer.drafters.families import family_of
from trainer.errors import UserError
from trainer.paths import project_path

ACCEPTS = ("dflash", "eagle3")
# The speculators release whose config schema and weight names this writer follows (and the tests load with).
SCHEMA_VERSION = "0.9.0"
# Our config fields that are not the decoder layers' own transformer config (``num_target_layers`` stays: an
# extra field to speculators, and what reading the directory back needs).
DRAFTER_FIELDS = (
    "architectures",
    "auto_map",
    "block_size",
    "dflash_config",
    "draft_vocab_size",
    "eagle_config",
    "treeflash_config",
    "_name_or_path",
)
# EAGLE-3 drafts this many tokens per step unless the engine's speculative config says otherwise.
EAGLE3_SPECULATIVE_TOKENS = 3


def vllm_aux_layer_ids(target_layer_ids: Sequence[int]) -> list[int]:
    """vLLM's ``aux_hidden_state_layer_ids`` (DFlash) and ``eagle_aux_hidden_state_layer_ids`` (EAGLE-3) for a
    drafter trained on the outputs of target layers ``target_layer_ids``: HF ``hidden_states`` indices, each id + 1.
    :func:`target_layer_ids_from_vllm` reads them back."""
    # vllm model_executor/models/llama.py (qwen2.py, qwen3.py alike) LlamaModel.forward appends, for a key value k,
    # the residual stream entering layer k (0.32: leaving layer k - 1, `if layer_idx + 1 in
    # self.aux_hidden_state_layers` after layer layer_idx): the output of layer k - 1, HF hidden_states[k].
    # transformers_utils/configs/speculators/algos.py (update_eagle3, update_dflash) hands the speculators key to
    # that loop as eagle_aux_hidden_state_layer_ids unchanged.
    return [int(i) + 1 for i in target_layer_ids]


def target_layer_ids_from_vllm(aux_layer_ids: Sequence[int]) -> list[int]:
    """The target layers whose outputs vLLM's ``aux_layer_ids`` name: the inverse of :func:`vllm_aux_layer_ids`."""
    return [int(i) - 1 for i in aux_layer_ids]


def transformer_layer_config(config: PretrainedConfig) -> dict[str, Any]:
    # The difference to the class defaults, as speculators serialises it; a reader rebuilds the rest.
    return {k: v for k, v in config.to_diff_dict().items() if k not in DRAFTER_FIELDS}


def verifier_entry(verifier: str | None) -> dict[str, Any]:
    """``{name_or_path, architectures}`` of the target; its architectures are read when the path is local."""
    architectures: list[str] = []
    config = project_path(verifier) / "config.json" if verifier is not None else None
    if config is not None and config.is_file():
        architectures = json.loads(config.read_text()).get("architectures") or []
    return {"name_or_path": verifier, "architectures": architectures}


def speculators_config(algorithm: str, tokens: int, verifier: str | None) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": verifier_entry(verifier),
    }


def dflash_layout(drafter: DFlashDraftModel, verifier: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = drafter.config
    aux = vllm_aux_layer_ids(drafter.target_layer_ids)
    if config.num_target_layers in aux:
        raise UserError(
            f"the DFlash drafter reads the target's last layer ({config.num_target_layers - 1}), which vLLM "
            f"passes separately; speculators cannot describe target layers {drafter.target_layer_ids}"
        )
    fields = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "speculators_config": speculators_config("dflash", drafter.block_size - 1, verifier),
        "transformer_layer_config": transformer_layer_config(config),
        "draft_vocab_size": config.vocab_size,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "aux_hidden_state_layer_ids": aux,
        "target_hidden_size": None,
    }
    return fields, dict(drafter.state_dict())


def eagle3_layout(drafter: Eagle3DraftModel, verifier: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = drafter.config
    fields = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_config": speculators_config("eagle3", EAGLE3_SPECULATIVE_TOKENS, verifier),
        "transformer_layer_config": transformer_layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(drafter.target_layer_ids),
        "norm_before_residual": False,
        "target_hidden_size": None,
    }
    weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    if config.draft_vocab_size == config.vocab_size:
        # A full draft vocabulary has no mapping: speculators registers no d2t/t2d buffers then.
        del weights["d2t"], weights["t2d"]
    return fields, weights


def write(drafter: PreTrainedModel, out: Path, verifier: str | None) -> None:
    layout = {"dflash": dflash_layout, "eagle3": eagle3_layout}[family_of(drafter).name]
    fields, weights = layout(drafter, verifier)
    dtype = next(drafter.parameters()).dtype
    config = {**fields, "speculators_version": SCHEMA_VERSION, "dtype": str(dtype).removeprefix("torch.")}
    out.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load(path: Path) -> DFlashDraftModel | Eagle3DraftModel:
    """The drafter of a directory this module wrote (or any speculators DFlash / EAGLE-3 directory in the same
    layout), as our class: the inverse of :func:`write`."""
    config = json.loads((Path(path) / "config.json").read_text())
    layer = dict(config["transformer_layer_config"])
    weights = load_file(str(Path(path) / "model.safetensors"))
    kind = config.get("speculators_model_type")
    if kind == "dflash":
        if config.get("sliding_window_non_causal"):
            raise UserError(
                f"{path}: sliding_window_non_causal is set: its sliding layers attend bidirectionally inside a "
                "block, which DFlashDraftModel does not compute (its sliding layers are causal in the block)"
            )
        layer.update(
            architectures=["DFlashDraftModel"],
            block_size=config["block_size"],
            dflash_config={
                "mask_token_id": config["mask_token_id"],
                "target_layer_ids": target_layer_ids_from_vllm(config["aux_hidden_state_layer_ids"]),
            },
        )
        drafter = DFlashDraftModel(Qwen3Config.from_dict(layer))
    elif kind == "eagle3":
        layer.update(
            architectures=[EAGLE3_ARCHITECTURE],
            draft_vocab_size=config["draft_vocab_size"],
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(
                    target_layer_ids_from_vllm(config["eagle_aux_hidden_state_layer_ids"])
                )
            },
        )
        drafter = Eagle3DraftModel(LlamaConfig.from_dict(layer))
        weights = {k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}
        # Without a mapping the draft vocabulary is the target's, which the new drafter's buffers already say.
        weights.setdefault("d2t", drafter.d2t)
        weights.setdefault("t2d", drafter.t2d)
    else:
        raise UserError(f"{path}: speculators_model_type {kind!r} is neither 'dflash' nor 'eagle3'")
    drafter.load_state_dict(weights, strict=True)
    return drafter.eval()
