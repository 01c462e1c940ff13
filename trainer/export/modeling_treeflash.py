"""TreeFlash drafter as a self-contained model file, shipped inside every ``--format treeflash`` export.

``AutoModel.from_pretrained(DIR, trust_remote_code=True)`` loads an exported directory through this file (its
``config.json`` maps ``AutoModel`` here), with nothing from this project installed: it imports only torch and
transformers. Parameter names follow the reference TreeFlash layout: the DFlash backbone under ``model.``
(``layers.{i}``, ``fc``, ``hidden_norm``, ``norm``) and the SwiGLU AR-approximator under
``ar_approximation.{norm, ug, d}``. The forward takes the reference's keyword arguments::

    drafter = AutoModel.from_pretrained("out/treeflash", trust_remote_code=True).eval()
    normed = drafter(position_ids=pos, noise_embedding=block_embeds, target_hidden=features)      # marginals
    corrected = drafter(position_ids=pos, noise_embedding=block_embeds, target_hidden=features,
                        prev_token_embds=prev_embeds)                                            # per slot

Shapes: ``noise_embedding`` (B, Q, H) the target's embeddings of the block (anchor, MASK, ...); ``target_hidden``
(B, C, n*H) the concatenated target hidden states of the ``C`` context positions not yet cached; ``position_ids``
(B, C + Q); ``prev_token_embds`` (B, Q, H) or (B, Q, M, H) embeddings of each slot's previous token. The output
is the final-normed hidden state (B, Q, H) or (B, Q, M, H); the target's LM head turns it into logits.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config, Qwen3PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Shape: x (B, heads, T, D); cos, sin (B, T, D)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class ContextAttention(nn.Module):
    """Qwen3 attention whose keys and values read ``concat[context, block]``; queries come from the block only."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, block, context, cos, sin, mask, cache):
        b, q, _ = block.shape
        kv = torch.cat([context, block], dim=1)
        query = self.q_norm(self.q_proj(block).view(b, q, self.heads, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv).view(b, kv.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv).view(b, kv.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        query, key = _rotate(query, cos[:, -q:], sin[:, -q:]), _rotate(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        groups = self.heads // self.kv_heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = ContextAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, block, context, cos, sin, mask, cache):
        block = block + self.self_attn(self.input_layernorm(block), context, cos, sin, mask, cache)
        return block + self.mlp(self.post_attention_layernorm(block))


class Backbone(nn.Module):
    """The DFlash drafter: ``hidden_norm(fc(features))`` as context, decoder layers over the block, final norm."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = config.dflash_config
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = int(config.block_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)


class SwiGLUApproximation(nn.Module):
    """``d(silu(G) * U)`` with ``[U, G] = ug(concat[norm(E[x_prev]), norm(h)])``: the correction added to ``h``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.norm = Qwen3RMSNorm(hidden_size, eps=1e-6)
        self.ug = nn.Linear(2 * hidden_size, 2 * intermediate_size, bias=True)
        self.d = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, prev_token_embds: torch.Tensor, normed_hidden: torch.Tensor) -> torch.Tensor:
        u, g = self.ug(torch.cat([self.norm(prev_token_embds), normed_hidden], dim=-1)).chunk(2, dim=-1)
        return self.d(F.silu(g) * u)


class TreeFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        approximation = (getattr(config, "treeflash_config", None) or {}).get("ar_approximation", "swiglu")
        if approximation != "swiglu":
            raise ValueError(f"treeflash_config.ar_approximation must be 'swiglu', got {approximation!r}")
        self.model = Backbone(config)
        self.ar_approximation = SwiGLUApproximation(config.hidden_size, config.intermediate_size)
        self.post_init()

    @property
    def target_layer_ids(self) -> list[int]:
        return self.model.target_layer_ids

    @property
    def mask_token_id(self) -> int | None:
        return self.model.mask_token_id

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def forward(
        self,
        position_ids: torch.LongTensor,
        prev_token_embds: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """Normed hidden states of the block slots; corrected by ``prev_token_embds`` when given (see the module
        docstring for shapes). ``attention_mask`` is additive (B, 1, Q, P + C + Q) or None (every key);
        ``past_key_values`` receives the new context and block keys when given."""
        if use_cache and past_key_values is None:
            raise ValueError("use_cache=True needs a DynamicCache in past_key_values")
        block = noise_embedding
        context = self.model.hidden_norm(self.model.fc(target_hidden))
        cos, sin = self.model.rotary_emb(block, position_ids)
        for layer in self.model.layers:
            block = layer(block, context, cos, sin, attention_mask, past_key_values)
        normed = self.model.norm(block)
        if prev_token_embds is None:
            return normed
        if prev_token_embds.dim() == block.dim() + 1:
            # One row per candidate previous token: (B, Q, M, H).
            block = block.unsqueeze(-2).expand_as(prev_token_embds)
            normed = normed.unsqueeze(-2).expand_as(prev_token_embds)
        return self.model.norm(block + self.ar_approximation(prev_token_embds, normed))
