"""EAGLE-3 drafter (docs/algorithms.md §6): one decoder layer over fused target features, a reduced draft vocabulary.

The outputs of three target decoder layers - ``target_layer_ids``, by default ``[1, L//2-1, L-4]`` of an
``L``-layer target in this project's layer-id convention (layer ``l``'s output is HF ``hidden_states[l+1]``, so
these are ``hidden_states[2, L//2, L-3]``, :attr:`Eagle3DraftModel.aux_layer_ids`) - are concatenated per
position and fused by ``fc: 3H -> H``. One decoder layer (``midlayer``) then reads, per position, a hidden state
``h`` (the fused feature, or the drafter's own previous pre-norm output when it drafts further ahead) and the
target's input embedding ``e`` of a token: its queries, keys and values are projected from
``concat[input_layernorm(e), hidden_norm(h)]`` (``2H`` wide), with RoPE and grouped-query attention; the
residual stream is ``h``; a SwiGLU MLP follows. The final ``norm`` and ``lm_head`` give logits over the draft
vocabulary; ``d2t`` maps a draft id ``d`` to the target id ``d + d2t[d]``, and ``t2d`` marks the target ids
that have a draft id. The drafter owns no input embedding: the caller embeds tokens with the target's.

Position ``t`` fed ``(f_t, E[x_{t+1}])`` predicts ``x_{t+2}``; fed its own output and ``E[x_{t+2}]`` at the
next position it predicts ``x_{t+3}``, and so on.

Parameter names and ``config.json`` follow SGLang's ``LlamaForCausalLMEagle3`` export: a Llama config with
``num_hidden_layers: 1``, ``draft_vocab_size``, ``eagle_config: {eagle_aux_hidden_state_layer_ids}`` (in SGLang's
convention, :func:`sglang_layer_ids`: the ``target_layer_ids`` themselves) and weights ``midlayer.*``,
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. ``config.json`` also carries the legacy
``rope_theta`` / ``rope_scaling`` keys for engines on transformers 4.x.

On CPU, with a config-built Qwen3 target::

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trainer.drafters.eagle3 import Eagle3DraftModel, build_config

    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8)).eval()
    drafter = Eagle3DraftModel(build_config(target.config, draft_vocab_size=64))
    ids = torch.randint(0, 97, (1, 10))                                              # x_0 .. x_9
    hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in drafter.aux_layer_ids], dim=-1)        # (1, 10, 3*32)
    embeds = target.get_input_embeddings()(ids[:, 1:])                               # E[x_{t+1}], t < 9
    cache = drafter.make_cache()
    out = drafter(drafter.fuse(features[:, :-1]), embeds, torch.arange(9)[None], past_key_values=cache,
                  use_cache=True)                                                    # (1, 9, 32)
    draft = drafter.to_target(drafter.logits(out[:, -1]).argmax(-1))                 # a guess at x_10
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import LlamaConfig, PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from trainer.drafters.attention import MaskRule, additive_mask, attend
from trainer.drafters.common import DraftVocabHead, SdpaDrafter, drafter_config, eagle3_layer_ids, valid_layer_ids
from trainer.errors import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"


def sglang_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """SGLang's ``eagle_aux_hidden_state_layer_ids`` (the key of this drafter's ``config.json``) for the drafter's
    :attr:`~Eagle3DraftModel.target_layer_ids`, and back: the same numbers, the 0-based ids of the target layers
    whose outputs are the features. (HF ``hidden_states`` indices, one higher, are vLLM's meaning of the same key:
    :func:`trainer.export.speculators.vllm_aux_layer_ids`.)"""
    # sglang 0.5.23 srt/models/llama.py (qwen2.py, qwen3.py alike) LlamaForCausalLM.set_eagle3_layers_to_capture
    # sets layers_to_capture = [id + 1 for id in layer_ids], and the model captures the residual stream entering
    # each layer in layers_to_capture: id + 1's input, the output of layer id. The ids come unchanged from the
    # draft config (srt/model_executor/model_runner_components/spec_aux_hidden_state.py
    # _resolve_eagle_aux_hidden_state).
    return [int(i) for i in layer_ids]


def build_config(
    target_config: PretrainedConfig,
    draft_vocab_size: int,
    target_layer_ids: Sequence[int] | None = None,
    **overrides: Any,
) -> LlamaConfig:
    """A drafter config for ``target_config``: its width, heads, RoPE, vocabulary size and norm eps.

    The hidden size must equal the target's (the inputs are the target's embeddings and hidden states);
    ``intermediate_size`` and the rest may be overridden. ``target_layer_ids`` are the three target layers whose
    outputs are the features, default :func:`~trainer.drafters.common.eagle3_layer_ids`.
    """
    text = target_config.get_text_config()
    num_target_layers = text.num_hidden_layers
    if not 0 < draft_vocab_size <= text.vocab_size:
        raise UserError(
            f"draft_vocab_size must be within 1..{text.vocab_size} (the target's vocabulary), got {draft_vocab_size}"
        )
    if target_layer_ids is None:
        target_layer_ids = eagle3_layer_ids(num_target_layers, "EAGLE-3")
    layer_ids = valid_layer_ids(target_layer_ids, num_target_layers)
    if len(layer_ids) != 3:
        raise UserError(f"EAGLE-3 reads three target layers; target_layer_ids {layer_ids} name {len(layer_ids)}")
    fields: dict[str, Any] = {
        "draft_vocab_size": draft_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(layer_ids)},
        "architectures": [ARCHITECTURE],
    }
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields[token] = getattr(text, token, None)
    return drafter_config(
        LlamaConfig, text, 1, fields, overrides, reads="it reads the target's embeddings and hidden states"
    )


def legacy_rope_fields(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and (for scaled RoPE) ``rope_scaling`` as transformers 4.x configs spell them."""
    out: dict[str, Any] = {"rope_theta": rope_parameters["rope_theta"]}
    if rope_parameters.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return out


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the ``2H``-wide ``concat[embedding, hidden]`` input."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | BlockMask,
        cache: Cache | None,
        update_cache: bool,
    ) -> torch.Tensor:
        # Shape: x (B, T, 2H); attention_mask (B or 1, 1, T, P + T) additive or a block mask, P the cached positions
        batch, q_len, _ = x.shape
        # Shape: query (B, heads, T, D); key, value (B, kv_heads, T, D)
        query = self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(batch, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(batch, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)

        if cache is not None and update_cache:
            # Shape: (B, kv_heads, P + T, D)
            key, value = cache.update(key, value, 0)
        elif cache is not None and cache.get_seq_length(0) > 0:
            # Read the cached keys without keeping the new ones (e.g. scoring candidates that will be dropped).
            layer = cache.layers[0]
            key, value = torch.cat([layer.keys, key], dim=-2), torch.cat([layer.values, value], dim=-2)

        # Shape: (B, heads, T, D)
        out = attend(query, key, value, attention_mask, self.scaling)
        # Shape: (B, T, heads * D) -> (B, T, H)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    """The one drafter layer: attention over ``concat[input_layernorm(e), hidden_norm(h)]``, residual on ``h``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        input_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | BlockMask,
        cache: Cache | None,
        update_cache: bool,
    ) -> torch.Tensor:
        # Shape: hidden, input_embeds (B, T, H) -> (B, T, 2H): the token first, then the hidden state
        x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, position_embeddings, attention_mask, cache, update_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3DraftModel(SdpaDrafter, DraftVocabHead, LlamaPreTrainedModel):
    """The EAGLE-3 drafter: ``fc`` over three target features, ``midlayer``, ``norm``, draft-vocabulary ``lm_head``."""

    main_input_name = "input_embeds"
    _no_split_modules: ClassVar[list[str]] = ["Eagle3DecoderLayer"]

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        if config.num_hidden_layers != 1:
            raise UserError(
                f"an EAGLE-3 drafter has exactly one decoder layer; the config has {config.num_hidden_layers}"
            )
        eagle = getattr(config, "eagle_config", None) or {}
        if "eagle_aux_hidden_state_layer_ids" not in eagle or not getattr(config, "draft_vocab_size", None):
            raise UserError(
                "an EAGLE-3 config needs draft_vocab_size and eagle_config.eagle_aux_hidden_state_layer_ids"
            )
        self.target_layer_ids: list[int] = sglang_layer_ids(eagle["eagle_aux_hidden_state_layer_ids"])
        hidden, draft_vocab = config.hidden_size, config.draft_vocab_size
        self.midlayer = Eagle3DecoderLayer(config)
        # [H, 3H]: the three concatenated target hidden states to one hidden state per position.
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_draft_vocab(config.vocab_size, draft_vocab)
        self.post_init()

    @property
    def aux_layer_ids(self) -> list[int]:
        """The feature layers as HF ``hidden_states`` indices (layer ``l``'s output is ``hidden_states[l + 1]``)."""
        return [i + 1 for i in self.target_layer_ids]

    # ---- forward ------------------------------------------------------------------------------------------
    def make_cache(self) -> DynamicCache:
        """An empty KV cache for :meth:`forward` (one layer)."""
        return DynamicCache(config=self.config)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Shape: (..., 3H) target features (the ``aux_layer_ids`` hidden states concatenated) → (..., H)."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"features have {features.shape[-1]} channels; expected {self.fc.in_features} "
                f"(the target's hidden_states {self.aux_layer_ids} concatenated)"
            )
        return self.fc(features)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Shape: (..., H) pre-norm output of :meth:`forward` → (..., draft_vocab_size) draft-vocabulary logits."""
        return self.lm_head(self.norm(prenorm))

    def forward(
        self,
        hidden: torch.Tensor,
        input_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | MaskRule | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """The pre-norm output hidden state of every new position. Shape: (B, T, H).

        - ``hidden`` (B, T, H): :meth:`fuse` of the target features at each position, or the drafter's own
          pre-norm output (this method's return value) at the position a drafted token continues from.
        - ``input_embeds`` (B, T, H): the target's input embedding of the token at each position (the token
          *after* the position whose hidden state is given).
        - ``position_ids`` (B, T): RoPE positions of the new positions.
        - ``attention_mask``: ``None`` for causal attention over the ``P`` cached positions and the new ones in
          order, or an additive float mask (B or 1, 1, T, P + T), ``0`` where a new position may attend and
          ``finfo.min`` elsewhere (a tree mask, or packed samples), or a
          :class:`~trainer.drafters.attention.MaskRule` built for ``self.attention`` (training). A boolean mask is
          refused.
        - ``past_key_values``: a cache from :meth:`make_cache`; its keys come first in the key sequence.
        - ``use_cache``: append the new keys/values to ``past_key_values`` (else it is only read). Drop drafted
          positions afterwards with ``past_key_values.crop(-n)`` (transformers 5.x takes the count to remove).
        """
        if use_cache and past_key_values is None:
            raise ValueError("use_cache=True needs a cache from make_cache() in past_key_values")
        q_len = input_embeds.shape[1]
        if hidden.shape != input_embeds.shape or position_ids.shape[-1] != q_len:
            raise ValueError(
                f"hidden {tuple(hidden.shape)}, input_embeds {tuple(input_embeds.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must cover the same (B, T) positions"
            )
        past = past_key_values.get_seq_length(0) if past_key_values is not None else 0
        dtype = hidden.dtype
        if attention_mask is None:
            allowed = torch.ones(q_len, past + q_len, dtype=torch.bool, device=hidden.device).tril(past)
            attention_mask = additive_mask(allowed, dtype)[None, None]
        elif isinstance(attention_mask, MaskRule):
            if (attention_mask.q_len, attention_mask.kv_len) != (q_len, past + q_len):
                raise ValueError(
                    f"attention_mask covers {(attention_mask.q_len, attention_mask.kv_len)} (queries, keys); "
                    f"expected ({q_len}, {past + q_len}) for {q_len} new and {past} cached positions"
                )
            attention_mask = attention_mask.build(self.attention, dtype)
        elif attention_mask.dtype == torch.bool:
            raise ValueError("attention_mask must be additive float (0 / finfo.min), not boolean")
        else:
            attention_mask = additive_mask(attention_mask, dtype)
        if not isinstance(attention_mask, BlockMask) and attention_mask.shape[-2:] != (q_len, past + q_len):
            raise ValueError(
                f"attention_mask covers {tuple(attention_mask.shape[-2:])} (queries, keys); expected "
                f"({q_len}, {past + q_len}) for {q_len} new and {past} cached positions"
            )
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(hidden, input_embeds, position_embeddings, attention_mask, past_key_values, use_cache)

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """HF ``save_pretrained`` with SGLang's architecture name (HF writes the class name) and the legacy RoPE
        keys in ``config.json`` for engines on transformers 4.x."""
        super().save_pretrained(save_directory, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        path = Path(save_directory) / "config.json"
        config = json.loads(path.read_text())
        config.update(legacy_rope_fields(self.config.rope_parameters), architectures=[ARCHITECTURE])
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
