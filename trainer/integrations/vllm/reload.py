"""Hot reload of the served drafter: a watched publish directory's new version is swapped into vLLM between steps.

The bandit daemon publishes drafter versions (``PUB/current`` names ``vNNNNNN``, a directory holding the drafter
in our HF format: :mod:`trainer.snapshots`). Between two steps (the runner's ``execute_model`` starts with
:meth:`Reloader.poll`) the plugin reads ``current`` at most every ``poll_seconds``; a new version is loaded with
our loader, converted to the speculators layout's weight names (what vLLM's drafter ``load_weights`` maps from)
and copied into the served drafter with vLLM's in-place reloader (``model_loader.reload``: the CPU backend
repacks linear weights, so a plain ``load_weights`` on a loaded model is wrong). Modules the drafter shares with
the target (the embedding) are in no published version and keep their tensors.

A version is refused, counted and skipped for good when it cannot be loaded or does not match the served
drafter's architecture (weight names, shapes, target layers, block size); the old weights keep serving. The
drafts of a step are logged with the version that drafted them (``drafter_version``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trainer.drafters import load_drafter
from trainer.drafters.families import FAMILIES, family_of
from trainer.export.dflash import as_dflash
from trainer.export.speculators import dflash_layout, eagle3_layout
from trainer.export.speculators import load as load_speculators
from trainer.integrations.vllm.config import PluginError
from trainer.integrations.vllm.metrics import DrafterFigures
from trainer.snapshots import read_current

logger = logging.getLogger("trainer.integrations.vllm")


class RefusedVersion(Exception):
    """A published version the served drafter cannot take; the message says why."""


def layout(drafter: torch.nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The speculators layout's architecture fields and weights of one of our drafters."""
    method = family_of(drafter).vllm_method
    if method == "eagle3":
        return eagle3_layout(drafter, None)
    if method == "dflash":
        return dflash_layout(as_dflash(drafter), None)
    served = [f.cls.__name__ for f in FAMILIES.values() if f.vllm_method]
    raise RefusedVersion(f"a {type(drafter).__name__} has no vLLM drafter ({', '.join(served)})")


# What must agree between the served drafter and a new version besides the weights' names and shapes.
ARCHITECTURE = ("speculators_model_type", "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids",
                "block_size", "mask_token_id", "draft_vocab_size")  # fmt: skip


def served_drafter(path: Path) -> torch.nn.Module:
    """The drafter vLLM was started with, as our class: a speculators directory or one of our own layouts."""
    config = (Path(path) / "config.json").read_text()
    return load_speculators(path) if '"speculators_model_type"' in config else load_drafter(path)


def reload_in_place(draft: torch.nn.Module, target: torch.nn.Module, vllm_config: Any, weights: Any) -> None:
    """vLLM's layerwise in-place reload (``model_loader.reload``) restricted to the drafter's own layers: a layer
    that is the target's or holds its parameters (the shared embedding, a shared LM head) is in no published
    version, and putting it on the meta device like the others would lose it."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        get_layerwise_info,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    # By identity: vLLM shares a layer by assigning the target's module (prepacked weights may not own storage).
    shared = {id(m) for m in target.modules()} | {id(p) for p in target.parameters()}
    for layer in draft.modules():
        if id(layer) in shared or any(id(p) in shared for p in layer.parameters(recurse=False)):
            continue
        info = get_layerwise_info(layer)
        if info.can_load():
            continue
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)
    draft.load_weights(weights)
    finalize_layerwise_reload(draft, vllm_config.model_config)


class Reloader:
    def __init__(self, watch: Path, poll_seconds: float, recorder: Any, figures: DrafterFigures) -> None:
        self.watch = Path(watch)
        # Swaps, refusals and the version serving, for vLLM's /metrics (trainer.integrations.vllm.metrics).
        self.figures = figures
        self.poll_seconds = poll_seconds
        self.recorder = recorder
        self.runner: Any = None
        self.reference: tuple[dict[str, Any], dict[str, tuple]] | None = None
        self.refused: set[int] = set()
        self.swap_ms: list[float] = []
        self._next_poll = 0.0

    @property
    def swaps(self) -> int:
        return len(self.swap_ms)

    def attach(self, runner: Any) -> None:
        """Remember the served drafter's architecture (from the directory vLLM loaded it from)."""
        if runner.get_draft_model() is None:
            raise PluginError(f"TRAINER_VLLM_WATCH={self.watch} needs a drafter in vLLM's speculative config")
        self.runner = runner
        fields, weights = layout(served_drafter(Path(runner.speculative_config.model)))
        self.reference = self._signature(fields, weights)

    @staticmethod
    def _signature(fields: dict[str, Any], weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
        return {k: fields.get(k) for k in ARCHITECTURE}, {k: tuple(v.shape) for k, v in weights.items()}

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_seconds
        try:
            current = read_current(self.watch)
        except Exception as e:  # a torn or foreign pointer: keep serving, say so once per poll
            logger.warning("trainer plugin: cannot read %s: %s", self.watch, e)
            return
        if current is None or current[0] == self.recorder.version or current[0] in self.refused:
            return
        version, directory = current
        try:
            self.swap(version, directory)
        except RefusedVersion as e:
            self.refused.add(version)
            self.figures.add("refused")
            logger.error("trainer plugin: refused drafter version %d from %s: %s; the old weights keep serving",
                         version, directory, e)  # fmt: skip

    def swap(self, version: int, directory: Path) -> None:
        start = time.perf_counter()
        try:
            drafter = load_drafter(directory)
        except Exception as e:
            raise RefusedVersion(f"cannot load it ({type(e).__name__}: {e})") from None
        fields, weights = layout(drafter)
        signature = self._signature(fields, weights)
        assert self.reference is not None
        if signature != self.reference:
            diff = [k for k in signature[0] if signature[0][k] != self.reference[0][k]]
            names = set(signature[1]) ^ set(self.reference[1])
            shapes = [k for k in signature[1] if k in self.reference[1] and signature[1][k] != self.reference[1][k]]
            raise RefusedVersion(f"architecture differs from the served drafter: fields {diff}, "
                                 f"weights missing/extra {sorted(names)[:5]}, shapes {shapes[:5]}")  # fmt: skip
        # In our dtype: vLLM's weight loaders convert while copying (the drafter's own tensors may be prepacked).
        reload_in_place(
            self.runner.get_draft_model(), self.runner.get_model(), self.runner.vllm_config, iter(weights.items())
        )
        self.recorder.version = version
        self.figures.add("swaps")
        self.figures.set("version", version)
        self.swap_ms.append(1000 * (time.perf_counter() - start))
        logger.info("trainer plugin: drafter version %d from %s swapped in (%.1f ms)", version, directory,
                    self.swap_ms[-1])  # fmt: skip
