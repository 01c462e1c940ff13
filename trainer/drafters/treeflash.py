"""TreeFlash: a DFlash block drafter plus a zero-initialised SwiGLU AR-approximator (docs/algorithms.md §4).

The approximator corrects each slot's hidden state with the token before it::

    [U, G] = ug(concat[norm_e(E[x_prev]), norm(h)])      ug: Linear(2H -> 2I, bias)
    h'     = h + d(silu(G) * U)                           d:  Linear(I -> H), zero-initialised
    logits = W · norm(h')

With ``d = 0`` the model is exactly its DFlash backbone. Checkpoint layout is the reference TreeFlash format:
the DFlash config plus ``treeflash_config: {ar_approximation: "swiglu", candidate_tokens}``, backbone weights
under ``model.``, approximator under ``ar_approximation.{ug.weight, ug.bias, d.weight, norm.weight}``.

On CPU::

    python -c "from trainer.drafters.treeflash import TreeFlashDraftModel; \\
        m = TreeFlashDraftModel.from_dflash('checkpoints/dflash_tiny'); print(m)"
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel, Qwen3RMSNorm

from trainer.drafters.dflash import DFlashDraftModel


class SwiGLUApproximator(nn.Module):
    """The AR-approximation layer: one previous token's embedding corrects a slot's hidden state."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.norm = Qwen3RMSNorm(hidden_size, eps=1e-6)
        self.ug = nn.Linear(2 * hidden_size, 2 * intermediate_size, bias=True)
        self.d = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.d.weight)

    def forward(self, hidden: torch.Tensor, normed_hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """Shape: hidden, normed_hidden, prev_embedding (..., H) → corrected pre-norm hidden (..., H)."""
        u, g = self.ug(torch.cat([self.norm(prev_embedding), normed_hidden], dim=-1)).chunk(2, dim=-1)
        return hidden + self.d(nn.functional.silu(g) * u)


class TreeFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash backbone (``model``) + SwiGLU AR-approximator (``ar_approximation``)."""

    config_class = Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        tf = dict(getattr(config, "treeflash_config", None) or {})
        tf.setdefault("ar_approximation", "swiglu")
        tf.setdefault("candidate_tokens", 16)
        if tf["ar_approximation"] != "swiglu":
            raise ValueError(f"unsupported ar_approximation {tf['ar_approximation']!r}; only 'swiglu' exists")
        config.treeflash_config = tf
        config.architectures = ["TreeFlashDraftModel"]
        self.model = DFlashDraftModel(config)
        # The approximator is as wide as the backbone's MLP (the reference sizes it from the same config).
        self.ar_approximation = SwiGLUApproximator(config.hidden_size, config.intermediate_size)
        self.post_init()
        # post_init re-initialises Linear layers; the approximator must start as the identity.
        nn.init.zeros_(self.ar_approximation.d.weight)

    @classmethod
    def from_dflash(cls, backbone: DFlashDraftModel | str) -> TreeFlashDraftModel:
        """A TreeFlash drafter whose backbone is a copy of a DFlash drafter (object or directory)."""
        if isinstance(backbone, str):
            backbone = DFlashDraftModel.from_pretrained(backbone, dtype=torch.float32)
        config = Qwen3Config.from_dict(backbone.config.to_dict())
        config.treeflash_config = {"ar_approximation": "swiglu", "candidate_tokens": 16}
        model = cls(config)
        model.model.load_state_dict(backbone.state_dict())
        return model

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def mask_token_id(self) -> int:
        return self.model.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.model.target_layer_ids

    def backbone(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """The DFlash forward. Returns pre-norm and normed hidden states, each (B, Q, H)."""
        hidden = self.model(**kwargs, return_prenorm=True)
        return hidden, self.model.norm(hidden)

    def correct(self, hidden: torch.Tensor, normed: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """Corrected, normed hidden states for the given previous-token embeddings. Shape: (..., H) → (..., H)"""
        return self.model.norm(self.ar_approximation(hidden, normed, prev_embedding))
