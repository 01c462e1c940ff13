"""Optimisers of the recipes: AdamW, or Muon on hidden matrices with AdamW on the rest; linear warm-up and a
cosine decay to a floor, stepped every optimiser step.

Muon (Jordan et al., 2024) replaces each hidden weight matrix's momentum by its nearest semi-orthogonal matrix
(five Newton–Schulz iterations) and scales it to AdamW's update RMS (0.2·sqrt(max(fan_out, fan_in)), as in
Moonlight), so that one learning rate means the same step size in both groups. It pays off most when the
token budget is small: the tiny target learns bigram statistics in a fraction of AdamW's steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

# Quintic Newton–Schulz coefficients that drive every singular value of a norm-1 matrix towards ~1 in 5 steps.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5


def orthogonalize(update: torch.Tensor) -> torch.Tensor:
    """Approximately ``U V^T`` of ``update = U S V^T`` (singular values land in about [0.7, 1.2]).

    Runs in float32: ``torch.optim.Muon`` iterates in bfloat16, which CPUs without bf16 units execute more than
    ten times slower than float32.
    """
    a, b, c = _NS_COEFFICIENTS
    x = update.float()
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.T
    # Shape: x (m, n) with m <= n, so the Gram matrix is the small (m, m) one.
    x = x / (x.norm() + 1e-7)
    for _ in range(_NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).to(update.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for parameter groups with ``muon=True`` (2-D hidden matrices), AdamW for the others.

    Both groups take decoupled weight decay; ``lr`` of a Muon group is the AdamW-equivalent step size.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "momentum": momentum, "eps": eps, "weight_decay": 0.0})
        for group in self.param_groups:
            if "muon" not in group:
                raise ValueError("every MuonAdamW parameter group says muon=True or muon=False")
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon groups hold 2-D weight matrices only")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * wd)
                if group["muon"]:
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    buf.mul_(group["momentum"]).add_(p.grad)
                    # Nesterov: orthogonalise the look-ahead gradient + momentum.
                    update = orthogonalize(p.grad.add(buf, alpha=group["momentum"]))
                    p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
                    continue
                beta1, beta2 = group["betas"]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                denom = (state["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)
        return loss


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> dict[str, Any]:
    """A LightningModule ``configure_optimizers`` result: ``optimizer`` with a per-step warm-up + cosine schedule."""
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def adamw_warmup_cosine(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> dict[str, Any]:
    """AdamW (no decay on norms and biases) under :func:`warmup_cosine`."""
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
    )
    return warmup_cosine(optimizer, warmup_steps, total_steps, min_lr_ratio)


def muon_warmup_cosine(
    model: torch.nn.Module,
    muon_lr: float,
    adamw_lr: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
) -> dict[str, Any]:
    """:class:`MuonAdamW` under :func:`warmup_cosine`: Muon on the 2-D weights of ``model`` outside its input
    and output embeddings, AdamW (``adamw_lr``) on embeddings, norms and biases; no decay on norms and biases."""
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
    hidden, embed, flat = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in embeddings:
            embed.append(p)
        elif p.ndim == 2:
            hidden.append(p)
        else:
            flat.append(p)
    groups = [
        {"params": hidden, "muon": True, "lr": muon_lr, "weight_decay": weight_decay},
        {"params": embed, "muon": False, "lr": adamw_lr, "weight_decay": weight_decay},
        {"params": flat, "muon": False, "lr": adamw_lr, "weight_decay": 0.0},
    ]
    optimizer = MuonAdamW([g for g in groups if g["params"]], lr=adamw_lr)
    return warmup_cosine(optimizer, warmup_steps, total_steps, min_lr_ratio)
