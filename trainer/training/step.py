"""The training-step API: one optimiser step of a drafter against the frozen target, without a Lightning Trainer.

The adaptation daemons (``trainer adapt bandit``) call these for every family: DFlash, TreeFlash, EAGLE-3 and
SpecBlock. ``step_loss`` computes the loss with the functions the family's LightningModule's training step calls
(``dflash_loss``/``treeflash_loss`` in trainer/training/blocks.py, ``eagle3_loss`` in eagle3_losses.py,
``specblock_unroll``/``specblock_losses`` in specblock_losses.py), with the same anchor and launch draws for the
same ``(seed, step)``, so a step here equals one step of the LightningModule on the same batch. On CPU::

    target = Target(load_causal_lm("checkpoints/target_tiny"), list(drafter.target_layer_ids))
    batch = context_batch([ids], [len(prompt)], pad_id=0)
    loss = train_step(drafter, target, batch, torch.optim.AdamW(params, 1e-4), step=0)

The parameter subset is the optimiser's: parameters outside it keep their values (their gradients are
dropped). A non-finite loss or gradient raises ``NonFiniteStep`` before the optimiser moves anything.
``chain_logits`` is the drafters' side of shadow evaluation: each family's distributions along a logged chain.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from trainer.data.features import with_features
from trainer.data.pack import collate_features
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.eagle3 import Eagle3DraftModel
from trainer.drafters.families import family_of
from trainer.drafters.specblock import SpecBlockDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.target import Target
from trainer.training.blocks import block_batch, blocks_at, dflash_loss, slot_weights, treeflash_loss
from trainer.training.eagle3_losses import eagle3_loss, eagle3_unroll
from trainer.training.specblock_losses import SpecBlockOptions, context_blocks, specblock_losses, specblock_unroll

Drafter = DFlashDraftModel | TreeFlashDraftModel | Eagle3DraftModel | SpecBlockDraftModel


class NonFiniteStep(ArithmeticError):
    """The loss or a gradient was NaN/inf; the optimiser did not step."""


@dataclass(frozen=True)
class BlockStepOptions:
    """A DFlash or TreeFlash step; the LightningModules' arguments of the same names (TreeFlash reads no ``loss``:
    its loss is the forward KL of the corrected distribution)."""

    topk: int = 32
    gamma: float = 7.0
    max_anchors: int = 32
    seed: int = 0
    loss: Literal["ce", "kl"] = "ce"


@dataclass(frozen=True)
class Eagle3StepOptions:
    """An EAGLE-3 step; the LightningModule's arguments of the same names."""

    topk: int = 32
    ttt_steps: int = 7
    step_decay: float = 0.8


@dataclass(frozen=True)
class SpecBlockStepOptions:
    """A SpecBlock step: the teacher's top-k and the loss options (the LightningModule's arguments)."""

    topk: int = 32
    loss: SpecBlockOptions = field(default_factory=SpecBlockOptions)


StepOptions = BlockStepOptions | Eagle3StepOptions | SpecBlockStepOptions


def default_options(drafter: Drafter) -> StepOptions:
    """The options of ``drafter``'s family with the LightningModule's defaults."""
    return STEPS[family_of(drafter).name].options()


def context_batch(
    sequences: list[list[int]],
    loss_starts: list[int],
    pad_id: int,
    features: list[dict[str, torch.Tensor]] | None = None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Logged contexts (prompt + output ids) as a training batch, one sample per row: the loss covers positions
    from ``loss_starts[i]`` on (the output), as the chat template's loss mask covers a reply. ``features``, when
    given, are each sequence's target features computed before (``trainer.data.pack.FEATURE_KEYS``, Shape:
    (len(sequence), ...) each), padded in as an offline batch's are, so no step computes them again. The batch
    is on ``device`` (default the CPU)."""
    rows = [
        {
            "input_ids": ids,
            "loss_mask": [0] * start + [1] * (len(ids) - start),
            "position_ids": list(range(len(ids))),
            "doc_ids": [1] * len(ids),
            **(features[i] if features is not None else {}),
        }
        for i, (ids, start) in enumerate(zip(sequences, loss_starts, strict=True))
    ]
    return {k: v.to(device) for k, v in collate_features(rows, pad_id).items()}


def step_loss(
    drafter: Drafter, target: Target, batch: dict[str, torch.Tensor], step: int, options: StepOptions
) -> torch.Tensor:
    """The family's training loss of ``batch`` (online: the target computes features) at optimiser step ``step``."""
    _check(drafter, options)
    return STEPS[family_of(drafter).name].loss(drafter, target, batch, step, options)


def train_step(
    drafter: Drafter,
    target: Target,
    batch: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    step: int,
    options: StepOptions | None = None,
) -> float:
    """One optimiser step of the parameters in ``optimizer`` on ``batch``; returns the loss before the step.
    ``options`` default to the family's (``default_options``)."""
    options = options or default_options(drafter)
    with _stepping(drafter, optimizer):
        return _apply(step_loss(drafter, target, batch, step, options), optimizer)


def chain_depth(drafter: Drafter, options: StepOptions | None = None) -> int:
    """How many tokens after a root ``chain_logits`` gives distributions for: a block's drafted slots (DFlash,
    TreeFlash), the unrolled steps (EAGLE-3), the context block's slots (SpecBlock)."""
    options = options or default_options(drafter)
    return STEPS[family_of(drafter).name].depth(drafter, options)


@torch.no_grad()
def chain_logits(
    drafter: Drafter,
    target: Target,
    sequence: list[int],
    roots: list[int],
    options: StepOptions | None = None,
    features: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The drafter's logits over the target's vocabulary for depths ``1..chain_depth`` of the chain it drafts from
    each root position ``p`` (depth ``d`` drafts ``sequence[p + d]``), teacher-forced on ``sequence``: what the
    drafter proposes along the path the verifier accepted. Tokens outside a draft vocabulary get ``-inf``.
    TreeFlash's are the corrected distributions. No gradient, nothing stepped. ``features``: the target's
    features of ``sequence`` computed before (as ``context_batch`` takes them), else the target computes them.
    Shape: (N roots, D, V)
    """
    options = options or default_options(drafter)
    _check(drafter, options)
    if min(roots, default=1) < 1:
        raise ValueError(f"a root at position {min(roots)}: a chain starts after at least one context token")
    given = None if features is None else [features]
    device = next(drafter.parameters()).device
    batch = with_features(context_batch([sequence], [0], 0, given, device), target, options.topk)
    depth = chain_depth(drafter, options)
    at = torch.tensor(roots, device=batch["input_ids"].device)
    logits = STEPS[family_of(drafter).name].chain(drafter, target, batch, at, depth, options)
    return _target_vocab(drafter, logits, target.lm_head.out_features)


def _check(drafter: Drafter, options: StepOptions) -> None:
    wanted = type(default_options(drafter))
    if not isinstance(options, wanted):
        raise TypeError(f"a {type(drafter).__name__} step takes {wanted.__name__}, got {type(options).__name__}")


def _target_vocab(drafter: Drafter, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits placed at their target ids (``-inf`` elsewhere). Shape: (..., Vd) → (..., V)"""
    if logits.shape[-1] == vocab_size:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), -math.inf)
    full[..., drafter.to_target(torch.arange(logits.shape[-1], device=logits.device))] = logits
    return full


def _block_loss(drafter, target, batch, blocks, options: BlockStepOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits (B, N, K, V)) of a block drafter; TreeFlash's logits are the corrected ones."""
    family = family_of(drafter)
    weights = slot_weights(family.core(drafter).block_size, options.gamma, device=batch["input_ids"].device)
    if family.name == "treeflash":
        result = treeflash_loss(drafter, target, batch, blocks, weights)
    else:
        result = dflash_loss(drafter, target, batch, blocks, weights, options.loss)
    return result.loss, result.logits


# ---- per family: the loss of a batch, the chain depth, the chain's logits -----------------------------------------
def _eagle3_loss(drafter, target, batch, step: int, options: Eagle3StepOptions) -> torch.Tensor:
    return eagle3_loss(drafter, target, with_features(batch, target, options.topk), options.ttt_steps,
                       options.step_decay).loss  # fmt: skip


def _specblock_loss(drafter, target, batch, step: int, options: SpecBlockStepOptions) -> torch.Tensor:
    results = specblock_unroll(drafter, target, with_features(batch, target, options.topk), options.loss, step)
    return specblock_losses(results, options.loss, drafter.block_size).loss


def _block_step_loss(drafter, target, batch, step: int, options: BlockStepOptions) -> torch.Tensor:
    core = family_of(drafter).core(drafter)
    batch, blocks = block_batch(core, target, batch, options.topk, options.max_anchors, options.seed, step)
    return _block_loss(drafter, target, batch, blocks, options)[0]


def _eagle3_chain(drafter, target, batch, at: torch.Tensor, depth: int, options) -> torch.Tensor:
    # Step i at origin p - 1 (features of p - 1, token x_p) drafts x_{p+1+i}: depth i + 1 of root p.
    outputs, _ = eagle3_unroll(drafter, target, batch, depth)
    return torch.stack([drafter.logits(hidden[0, at - 1]) for hidden in outputs], dim=1)


def _specblock_chain(drafter, target, batch, at: torch.Tensor, depth: int, options) -> torch.Tensor:
    # The context block whose token is x_p sits at row p - shift; its slot k drafts x_{p+1+k}.
    hidden = context_blocks(drafter, target, batch, DynamicCache(config=drafter.config))
    return drafter.logits(drafter.norm(hidden[0, at - drafter.token_shift]), target.lm_head)


def _block_chain(drafter, target, batch, at: torch.Tensor, depth: int, options) -> torch.Tensor:
    anchors = at[None]
    blocks = blocks_at(family_of(drafter).core(drafter), batch, anchors, anchors >= 0)
    # Block slot k drafts anchor + k; slot 0 is the root itself.
    return _block_loss(drafter, target, batch, blocks, options)[1][0, :, 1:]


@dataclass(frozen=True)
class FamilySteps:
    """A family's side of this API: its options' type, the loss of a batch, how many tokens after a root its chain
    logits cover, and those logits (Shape: (N roots, D, Vd))."""

    options: type
    loss: Callable[..., torch.Tensor]
    depth: Callable[[Drafter, StepOptions], int]
    chain: Callable[..., torch.Tensor]


_BLOCK = FamilySteps(BlockStepOptions, _block_step_loss, lambda d, o: family_of(d).core(d).block_size - 1, _block_chain)
STEPS: dict[str, FamilySteps] = {
    "dflash": _BLOCK,
    "treeflash": _BLOCK,
    "eagle3": FamilySteps(Eagle3StepOptions, _eagle3_loss, lambda d, o: o.ttt_steps, _eagle3_chain),
    "specblock": FamilySteps(SpecBlockStepOptions, _specblock_loss, lambda d, o: d.block_size, _specblock_chain),
}


def _apply(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    """Backward and step, unless the loss or a gradient is not finite (then nothing moves)."""
    optimizer.zero_grad(set_to_none=True)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise NonFiniteStep(f"loss is {value}")
    loss.backward()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not torch.isfinite(p.grad).all():
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteStep("a gradient is not finite")
    optimizer.step()
    return value


@contextmanager
def _stepping(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Train mode, with ``requires_grad`` off for the drafter's parameters outside the optimiser (restored)."""
    inside = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frozen = [p for p in drafter.parameters() if id(p) not in inside and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    drafter.train()
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
