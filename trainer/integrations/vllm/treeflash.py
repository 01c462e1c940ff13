"""TreeFlash served by vLLM 0.32.0: a ``--format treeflash`` export drafts TreeFlash's chain, its approximator kept.

vLLM has DFlash, not TreeFlash. A TreeFlash export's config names ``TreeFlashDraftModel``; under
``"method": "dflash"`` vLLM renames that architecture ``DFlashTreeFlashDraftModel``
(``transformers_utils/configs/eagle.py``); :func:`install` registers both names as
:class:`~trainer.integrations.vllm.treeflash_model.TreeFlashQwen3ForCausalLM`: vLLM's DFlash drafter plus the
SwiGLU AR-approximator (``ar_approximation.*``), returning the pre-norm states the approximator corrects. The
runner's DFlash proposer is replaced by
:class:`~trainer.integrations.vllm.treeflash_model.TreeFlashProposer`, which drafts a block as DFlash does (one
forward of ``[next token, mask x K]``) and then chooses the K tokens in order: position 1 from the state corrected
by the next token, position ``d + 1`` from the state corrected by the token chosen at ``d`` (our engine's
``treeflash-chain`` builder). With any other drafter it is vLLM's DFlash proposer unchanged.

- Greedy requests: each position's argmax, exactly ``treeflash-chain`` (the parity gate checks it).
- Sampled requests (vLLM's default ``draft_sample_method="probabilistic"``): each position is sampled at the
  request's temperature from its corrected distribution given the token sampled before it, and those
  distributions go to vLLM's rejection sampler as the draft probabilities: the chain TreeFlash samples, and the
  output keeps the target's distribution. With ``draft_sample_method="greedy"`` the chain is the argmax one.

Serve it like DFlash, with the block less the root::

    vllm serve TARGET --speculative-config '{"method": "dflash", "model": "DIR", "num_speculative_tokens": 15}'

where ``DIR`` is ``trainer export RUN --format treeflash --out DIR``. The ``dflash`` export of a TreeFlash drafter
is its backbone and drafts DFlash's chain. The vLLM plugin's :func:`trainer.integrations.vllm.register` calls
:func:`install` in every vLLM process, configured or not; on another vLLM release it installs nothing and says so
(a TreeFlash export then fails to load: vLLM does not know its architecture).
"""

from __future__ import annotations

import logging
from typing import Any

# The vLLM release whose DFlash drafter, proposer and runner this module subclasses and routes (read in its source).
RELEASES = ("0.32.0",)
# A TreeFlash export's architecture (checked when vLLM reads the draft config), and what vLLM's EAGLEConfig renames
# it to under method ``dflash`` ("DFlash" + the name; the model vLLM builds).
ARCHITECTURES = ("TreeFlashDraftModel", "DFlashTreeFlashDraftModel")
logger = logging.getLogger("trainer.integrations.vllm")

_installed: bool | None = None


def serves_treeflash(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` speculates with a TreeFlash export (method ``dflash``, draft architecture ours)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if spec is None or draft is None or spec.method != "dflash":
        return False
    return bool(set(getattr(draft, "architectures", None) or ()) & set(ARCHITECTURES))


def install() -> bool:
    """Register the TreeFlash drafter with vLLM and route the runner's DFlash proposer through
    :class:`~trainer.integrations.vllm.treeflash_model.TreeFlashProposer` (once per process). Returns whether it is
    installed: False, with a warning, on a vLLM release other than :data:`RELEASES`."""
    global _installed
    if _installed is not None:
        return _installed
    import vllm

    if vllm.__version__ not in RELEASES:
        logger.warning("trainer plugin: TreeFlash drafting follows vLLM %s's private DFlash interfaces; this is vLLM "
                       "%s, so a --format treeflash export is not served (its architecture %s stays unknown)",
                       " and ".join(RELEASES), vllm.__version__, ARCHITECTURES[0])  # fmt: skip
        _installed = False
        return False
    from vllm import ModelRegistry
    from vllm.v1.worker import gpu_model_runner

    from trainer.integrations.vllm.treeflash_model import TreeFlashProposer

    # By name: vLLM imports the model in the process that builds it (the worker), not at plugin load.
    for name in ARCHITECTURES:
        ModelRegistry.register_model(name, "trainer.integrations.vllm.treeflash_model:TreeFlashQwen3ForCausalLM")
    # The runner builds ``DFlashProposer(...)`` from its module's global and checks drafters with isinstance against
    # that same global: every DFlash drafter it builds becomes a TreeFlashProposer, which is vLLM's own for DFlash.
    gpu_model_runner.DFlashProposer = TreeFlashProposer
    _installed = True
    return True
