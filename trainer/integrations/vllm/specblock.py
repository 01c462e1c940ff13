"""SpecBlock drafters in vLLM: what the plugin installs in every vLLM process, configured or not.

vLLM has no SpecBlock drafter. A ``--format specblock`` export (:mod:`trainer.export.specblock`) is served through
vLLM's EAGLE-3 route: its ``config.json`` names the architecture ``SpecBlockDraftModel`` and carries
``eagle_aux_hidden_state_layer_ids`` (the drafter's target layers in vLLM's convention), so vLLM captures the
target features SpecBlock reads as EAGLE-3's auxiliary hidden states. :func:`install` registers the architecture
with vLLM's model registry (lazily: nothing of the drafter is imported until a SpecBlock export is served) and
routes the construction of vLLM's ``EagleProposer`` to
:class:`trainer.integrations.vllm.specblock_proposer.SpecBlockProposer` when the draft model is a SpecBlock export;
that proposer drafts SpecBlock's chain (one drafter forward per block of K tokens, for all requests of a step at
once). Nothing changes for any other drafter. Published versions hot-reload like EAGLE-3's (:func:`layout`: what
they must share with the served one). Both hooks follow private interfaces of the releases in
:data:`RELEASES`; on any other release ``install`` does nothing and vLLM refuses the architecture as unknown.

Serving (vLLM's own prefix cache cannot be used: a cached prefix has no target features for the drafter)::

    trainer export checkpoints/specblock_tiny --format specblock --out runs/export/specblock_tiny
    vllm serve checkpoints/target_tiny --no-enable-prefix-caching --no-async-scheduling --speculative-config \\
        '{"method": "eagle3", "model": "runs/export/specblock_tiny", "num_speculative_tokens": 8}'
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger("trainer.integrations.vllm")

# The vLLM release whose EAGLE proposer and runner this module subclasses and routes (read in its source).
RELEASES = ("0.32.0",)
ARCHITECTURE = "SpecBlockDraftModel"
# The export's architecture, and the name vLLM's EAGLE-3 config gives it (EAGLEConfig prefixes "Eagle3").
SERVED_ARCHITECTURES = (ARCHITECTURE, f"Eagle3{ARCHITECTURE}")
MODEL_CLASS = "trainer.integrations.vllm.specblock_proposer:SpecBlockForVllm"
# The module whose EagleProposer the runner constructs for method "eagle3".
EAGLE_MODULE = "vllm.v1.spec_decode.eagle"

_installed = False


def layout(drafter: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a published SpecBlock version must share with the served one (hot reload,
    :mod:`trainer.integrations.vllm.reload`), and its weights by the names the served drafter loads."""
    from trainer.export.speculators import vllm_aux_layer_ids

    fields = {
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(drafter.target_layer_ids),
        "block_size": drafter.block_size,
        "draft_vocab_size": drafter.draft_vocab_size,
        "alignment": drafter.alignment,
    }
    return fields, dict(drafter.state_dict())


def serves_specblock(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` speculates with a SpecBlock export (method ``eagle3``, draft architecture ours)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if spec is None or draft is None or spec.method != "eagle3":
        return False
    return bool(set(getattr(draft, "architectures", None) or ()) & set(SERVED_ARCHITECTURES))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` once, right after the module ``name`` is first executed (vLLM's proposer modules
    import half of vLLM, so the plugin waits for vLLM to import them rather than importing them itself)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        callback = self.callback

        def exec_module(module: ModuleType) -> None:
            execute(module)
            callback(module)

        # The loader is this import's own instance (one per found spec).
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after vLLM imports it."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


def route_proposer(eagle: ModuleType) -> None:
    """``EagleProposer(vllm_config, ...)`` builds a :class:`SpecBlockProposer` (a subclass: the runner's
    ``isinstance`` checks hold) when the draft model is a SpecBlock export; any other draft model is unchanged."""
    proposer = eagle.EagleProposer

    def new(cls: type, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        if cls is proposer and serves_specblock(vllm_config):
            from trainer.integrations.vllm.specblock_proposer import SpecBlockProposer

            cls = SpecBlockProposer
        return object.__new__(cls)

    proposer.__new__ = new


def install() -> bool:
    """Register SpecBlock exports with vLLM (once per process; every vLLM process calls the plugin's ``register``).
    Returns whether SpecBlock can be served: not on a vLLM release whose interfaces were not read."""
    global _installed
    if _installed:
        return True
    import vllm
    from vllm import ModelRegistry

    if vllm.__version__ not in RELEASES:
        logger.warning("trainer plugin: SpecBlock drafters are not served by vLLM %s (read: %s)", vllm.__version__,
                       ", ".join(RELEASES))  # fmt: skip
        return False
    for name in SERVED_ARCHITECTURES:
        ModelRegistry.register_model(name, MODEL_CLASS)
    after_import(EAGLE_MODULE, route_proposer)
    _installed = True
    return True
