"""The drafter families, by name: what each drafter class is, for every package that acts on drafters.

A family's behaviour elsewhere lives in the package that owns it, in one table keyed by ``Family.name``: the
drafting session (``trainer.decoding.builders.SESSIONS``), the training step's loss, depth and chain logits
(``trainer.training.step.STEPS``), the update options of the bandit (``trainer.adapt.bandit_daemon``), the export
formats (each format module's ``ACCEPTS``). This registry holds what the drafter classes define, and
``load_drafter``, which picks the class of an HF directory by the ``architectures`` its config names; it imports
nothing above ``trainer.drafters``. tests/test_families.py checks that every table names every family.
On CPU::

    python -c "from trainer.drafters import load_drafter; from trainer.drafters.families import family_of; \\
        print(family_of(load_drafter('checkpoints/treeflash_tiny')))"
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from trainer.drafters.common import DrafterDecoderLayer
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.eagle3 import ARCHITECTURE as EAGLE3_ARCHITECTURE
from trainer.drafters.eagle3 import Eagle3DecoderLayer, Eagle3DraftModel
from trainer.drafters.specblock import SpecBlockDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError
from trainer.paths import project_path


@dataclass(frozen=True)
class Family:
    """One drafter family.

    ``architecture``: the name a saved ``config.json`` carries (EAGLE-3's is SGLang's). ``backbone``: the attribute
    holding the module that reads the target (``block_size``, ``target_layer_ids``, the LoRA targets), or None when
    that is the drafter itself. ``approximator``: the attribute of an extra trainable part (TreeFlash's
    AR-approximator). ``vllm_method``: the speculative method vLLM serves its export with (None: vLLM has no
    such drafter). ``layer``: its decoder layer class (the unit FSDP2 shards)."""

    name: str
    cls: type[PreTrainedModel]
    architecture: str
    layer: type[nn.Module]
    backbone: str | None = None
    approximator: str | None = None
    vllm_method: str | None = None

    def core(self, drafter: nn.Module) -> nn.Module:
        """The module that reads the target: the backbone, or the drafter itself."""
        return getattr(drafter, self.backbone) if self.backbone else drafter

    def with_core(self, drafter: nn.Module, core: nn.Module) -> nn.Module:
        """``drafter`` with its core replaced by ``core`` (e.g. a LoRA-merged copy); returns the drafter."""
        if self.backbone is None:
            return core
        setattr(drafter, self.backbone, core)
        return drafter

    def parameters(self, drafter: nn.Module, part: str) -> list[nn.Parameter]:
        """A trainable part's parameters: ``full`` (everything) or ``approx`` (the approximator)."""
        if part == "full":
            return list(drafter.parameters())
        if part == "approx" and self.approximator is not None:
            return list(getattr(drafter, self.approximator).parameters())
        raise ValueError(f"a {self.name} drafter has no trainable part {part!r}")


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("dflash", DFlashDraftModel, "DFlashDraftModel", DrafterDecoderLayer, vllm_method="dflash"),
        Family(
            "treeflash",
            TreeFlashDraftModel,
            "TreeFlashDraftModel",
            DrafterDecoderLayer,
            "model",
            "ar_approximation",
            "dflash",
        ),
        Family("eagle3", Eagle3DraftModel, EAGLE3_ARCHITECTURE, Eagle3DecoderLayer, vllm_method="eagle3"),
        # Served by vLLM's EAGLE-3 route through this project's plugin (trainer.integrations.vllm.specblock).
        Family("specblock", SpecBlockDraftModel, "SpecBlockDraftModel", DrafterDecoderLayer, vllm_method="eagle3"),
    )
}
_BY_CLASS = {f.cls: f for f in FAMILIES.values()}


def family_of(drafter: nn.Module | type) -> Family:
    """The family of a drafter (or of a drafter class); ``TypeError`` for anything else."""
    cls = drafter if isinstance(drafter, type) else type(drafter)
    for klass in cls.__mro__:
        if klass in _BY_CLASS:
            return _BY_CLASS[klass]
    raise TypeError(f"a {cls.__name__} is no drafter of a known family ({', '.join(FAMILIES)})")


# The ``architectures`` name a saved config.json carries → the class that loads it.
DRAFTER_CLASSES: dict[str, type[PreTrainedModel]] = {f.architecture: f.cls for f in FAMILIES.values()}
# What ``drafter_class`` accepts: those names and each class's own (see there).
_BY_NAME = {name: f.cls for f in FAMILIES.values() for name in (f.cls.__name__, f.architecture)}


def drafter_class(architectures: Sequence[str], where: object) -> type[PreTrainedModel]:
    """The drafter class of a config's ``architectures``; ``where`` (a file) names the config in the error.

    A class's own name counts too: ``save_pretrained`` writes it into the in-memory config, which is what a
    training checkpoint records (EAGLE-3's file carries SGLang's name instead)."""
    for name in architectures:
        if name in _BY_NAME:
            return _BY_NAME[name]
    raise UserError(f"{where}: architectures {list(architectures)} name no drafter ({sorted(DRAFTER_CLASSES)})")


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A DFlash, TreeFlash, EAGLE-3 or SpecBlock drafter from an HF directory (a shipped one from any
    directory, ``trainer.paths``), by its ``architectures``."""
    path = project_path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"no drafter at {path}: {config_file} does not exist")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    return drafter_class(architectures, config_file).from_pretrained(path, dtype=dtype).eval()
