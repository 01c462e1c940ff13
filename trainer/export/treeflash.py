"""``--format treeflash``: the reference TreeFlash directory (``peerrh/treeflash-qwen3-4b``; ALGORITHMS.md §4).

``config.json`` is the DFlash config plus ``architectures: ["TreeFlashDraftModel"]``,
``treeflash_config: {ar_approximation: "swiglu", candidate_tokens}`` and an ``auto_map`` that sends ``AutoModel``
to the model file shipped beside the weights (:mod:`trainer.export.modeling_treeflash`, copied as
``modeling_treeflash.py``), so that ``AutoModel.from_pretrained(DIR, trust_remote_code=True)`` loads it as the
TreeFlash README does. Weights: the backbone under ``model.``, the approximator under ``ar_approximation.``. A
DFlash drafter exports as TreeFlash with a zero (identity) approximator, i.e. exactly its DFlash drafts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import PreTrainedModel

from trainer.drafters.families import family_of
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError
from trainer.export import modeling_treeflash

ACCEPTS = ("treeflash", "dflash")
MODEL_FILE = "modeling_treeflash.py"
AUTO_MAP = {"AutoModel": f"{Path(MODEL_FILE).stem}.TreeFlashDraftModel"}


def write(drafter: PreTrainedModel, out: Path, verifier: str | None) -> None:
    if family_of(drafter).name == "dflash":
        drafter = TreeFlashDraftModel.from_dflash(drafter).to(drafter.dtype)
    if "sliding_attention" in drafter.model.layer_types:
        # The shipped model file computes full-attention layers only: it would drop the window silently.
        raise UserError(
            f"--format treeflash cannot hold sliding-window layers (layer_types={drafter.model.layer_types}); "
            "export the DFlash backbone as dflash or speculators"
        )
    drafter.save_pretrained(out)
    shutil.copyfile(modeling_treeflash.__file__, out / MODEL_FILE)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = AUTO_MAP
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
