"""What the drafters share: config fields copied from the target, their checks, SDPA, a Qwen3 decoder layer.

Every drafter reads the target's input embeddings and hidden states, so its width, heads, RoPE, vocabulary and
norm eps are the target's (:func:`drafter_config`); and every drafter's attention runs SDPA or flex attention itself
with an explicit mask (:class:`SdpaDrafter`, :mod:`trainer.drafters.attention`). DFlash and SpecBlock share one Qwen3
decoder layer (:class:`DrafterDecoderLayer`), whose attention keys may be prefixed by a context that has no query of
its own.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import PretrainedConfig, Qwen3Config
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

from trainer.drafters.attention import attend
from trainer.drafters.vocab import DraftVocab
from trainer.errors import UserError

ConfigT = TypeVar("ConfigT", bound=PretrainedConfig)

# Why the hidden size is the target's, for a drafter that draws its inputs from the target's embedding and its
# logits from the target's LM head.
READS_EMBEDDINGS_FEEDS_LM_HEAD = "it reads the target's input embeddings and feeds the target's LM head"


def drafter_config(
    config_class: type[ConfigT],
    text: PretrainedConfig,
    num_layers: int,
    fields: Mapping[str, Any],
    overrides: Mapping[str, Any],
    reads: str = READS_EMBEDDINGS_FEEDS_LM_HEAD,
) -> ConfigT:
    """A ``config_class`` with the target's width, heads, RoPE, vocabulary and norm eps, then the drafter's own
    ``fields``, then the caller's ``overrides``.

    ``text`` is the target's text config. An override of ``hidden_size`` that differs from the target's is refused
    (``reads`` says why, in the error); any other field may be overridden.
    """
    if overrides.get("hidden_size", text.hidden_size) != text.hidden_size:
        raise UserError(
            f"the drafter's hidden_size must equal the target's ({text.hidden_size}): {reads}; "
            f"got hidden_size={overrides['hidden_size']}"
        )
    num_heads = text.num_attention_heads
    copied: dict[str, Any] = {
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        "hidden_act": getattr(text, "hidden_act", "silu"),
        "max_position_embeddings": text.max_position_embeddings,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "attention_bias": getattr(text, "attention_bias", False),
        "tie_word_embeddings": False,
    }
    rope = getattr(text, "rope_parameters", None)
    if rope:
        copied["rope_parameters"] = copy.deepcopy(dict(rope))
    return config_class(**{**copied, **fields, **overrides})


def eagle3_layer_ids(num_target_layers: int, family: str) -> list[int]:
    """EAGLE-3's feature layers, a low, a middle and a high one, which ``family`` reads by default: HF
    ``hidden_states[2, L//2, L-3]``, the outputs of layers ``[1, L//2 - 1, L - 4]`` (Qwen3-8B, 36 layers:
    ``[1, 17, 32]``; Llama-3.1-8B, 32 layers: ``[1, 15, 28]``)."""
    if num_target_layers < 4:
        raise UserError(
            f"{family} reads target layers [1, L//2 - 1, L - 4] by default and needs a target of at least 4 layers, "
            f"got {num_target_layers}; pass target_layer_ids explicitly"
        )
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def valid_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """``layer_ids`` as ints, refused unless non-empty and within the target's layers ``0..L-1``."""
    ids = [int(i) for i in layer_ids]
    if not ids or any(not 0 <= i < num_target_layers for i in ids):
        raise UserError(
            f"target_layer_ids {ids} must be non-empty and within the target's layers 0..{num_target_layers - 1}"
        )
    return ids


class SdpaDrafter:
    """HF class attributes of a drafter (listed before its ``PreTrainedModel`` base) whose attention runs through
    :func:`trainer.drafters.attention.attend` with an explicit mask: HF's attention kernels are not wired in, no
    outputs are recorded. ``attention`` is the path a training mask (a ``MaskRule``) is built for: ``auto``,
    ``flex`` or ``dense`` (:mod:`trainer.drafters.attention`); a run sets it, checkpoints do not hold it."""

    attention: str = "auto"

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_record_outputs: ClassVar[dict] = {}


class DraftVocabHead:
    """The ``d2t`` / ``t2d`` buffers of a drafter whose ``lm_head`` covers a reduced draft vocabulary (EAGLE-3's
    layout): draft id ``d`` is target id ``d + d2t[d]``; ``t2d`` (V,) marks the target ids that have a draft id."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def register_draft_vocab(self, vocab_size: int, draft_vocab_size: int) -> None:
        """Buffers of the identity vocabulary (draft id d is target id d) until :meth:`set_draft_vocab`."""
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", t2d)

    @property
    def draft_vocab(self) -> DraftVocab:
        return DraftVocab(d2t=self.d2t, t2d=self.t2d)

    def set_draft_vocab(self, vocab: DraftVocab) -> None:
        """Adopt ``vocab`` (its size must equal the head's draft vocabulary, its target vocabulary the config's)."""
        if vocab.d2t.shape != self.d2t.shape or vocab.t2d.shape != self.t2d.shape:
            raise UserError(
                f"draft vocabulary of {vocab.d2t.numel()} ids over {vocab.t2d.numel()} target ids does not fit a "
                f"drafter with draft_vocab_size {self.d2t.numel()} and vocab_size {self.t2d.numel()}"
            )
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids. Shape: any → same."""
        return draft_ids + self.d2t[draft_ids]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` (B, heads, T, D) with ``cos``/``sin`` (B, T, D) of the same T positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class QKNormAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm before RoPE, grouped-query) over an explicit mask through SDPA.

    With a ``context``, keys and values are projected from ``concat[context, hidden_states]``: the ``C`` context
    positions come first and have no query of their own (DFlash feeds the same projected target feature to every
    layer this way, so its keys can be cached independently of the block). Without one it is self-attention.
    """

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # Qwen3 normalises queries and keys per head, before RoPE.
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(
        self, hidden_states: torch.Tensor, context: torch.Tensor | None, position_embeddings: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated queries of the Q positions and keys and values of the C + Q positions.

        Shape: hidden_states (B, Q, H), context (B, C, H) or None (C = 0), cos/sin (B, C + Q, D) → query
        (B, heads, Q, D), key and value (B, kv_heads, C + Q, D)."""
        batch, q_len, _ = hidden_states.shape
        # Shape: (B, C + Q, H)
        kv_input = hidden_states if context is None else torch.cat([context, hidden_states], dim=1)
        kv_len = kv_input.shape[1]
        # Shape: (B, heads, Q, D), (B, kv_heads, C + Q, D)
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, self.num_heads, self.head_dim))
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_key_value_heads, self.head_dim))
        value = self.v_proj(kv_input).view(batch, kv_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        # Keys get every position; queries only the last Q, which are theirs.
        cos, sin = position_embeddings
        query = apply_rotary(query.transpose(1, 2), cos[:, -q_len:], sin[:, -q_len:])
        key = apply_rotary(key.transpose(1, 2), cos, sin)
        return query, key, value

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Attention of the queries over every key, through ``o_proj``. Shape: query (B, heads, Q, D), key and
        value (B, kv_heads, P + C + Q, D) → (B, Q, H)."""
        batch, _, q_len, _ = query.shape
        out = attend(query, key, value, attention_mask, self.scaling, self.attention_dropout if self.training else 0.0)
        # Shape: (B, Q, heads * D) -> (B, Q, H)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | BlockMask | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """Shape: hidden_states (B, Q, H), context (B, C, H) or None (C = 0), cos/sin (B, C + Q, D), attention_mask
        additive (B, 1, Q, P + C + Q) with P the cached positions, a flex block mask of that shape, or None (every
        key) → (B, Q, H)."""
        query, key, value = self.project(hidden_states, context, position_embeddings)
        if cache is not None:
            # Shape: (B, kv_heads, P + C + Q, D): rotated keys are cached, so a key keeps its position for good.
            key, value = cache.update(key, value, self.layer_idx)
        return self.attend(query, key, value, attention_mask)


def cached_keys(cache: Cache | None, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values ``cache`` holds for layer ``layer_idx`` (None: none yet), for a caller that attends to
    them followed by new ones and writes only the new ones (``cache.update``) itself. A sliding-window layer, whose
    ``update`` would return other keys than these followed by the new ones, is refused."""
    if cache is None or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    if getattr(layer, "is_sliding", False):
        raise ValueError(
            f"layer {layer_idx} of the cache is a sliding-window {type(layer).__name__}; a checkpointed drafter layer "
            "needs a full-attention cache (a drafter's cache_config)"
        )
    if not layer.is_initialized or layer.get_seq_length() == 0:
        return None
    return layer.keys, layer.values


class DrafterDecoderLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer over a drafter's query positions; its attention may also read a context.

    ``shift``, when given, maps the layer's input first (SpecBlock's layer shift, which mixes the slots of a
    block); it is registered before the other submodules, the order of the checkpoints and of initialisation.

    Gradient checkpointing: HF's ``gradient_checkpointing_enable`` sets ``gradient_checkpointing`` and
    ``_gradient_checkpointing_func`` here as on its own ``GradientCheckpointingLayer`` s, and a training forward
    with gradients then keeps only the layer's inputs and recomputes the rest in the backward. Unlike HF's layer,
    which replays the whole ``forward`` (a cache passed in would be written again by the replay, after everything
    written since: SpecBlock's unroll then met more keys in the backward than in the forward) or drops the cache,
    the replayed part here reads the cached keys as they were before the layer ran, as a tensor, and returns the
    new keys; they are written to the cache once, outside it. The layer's forward hooks (FSDP2's) stay outside too.
    """

    gradient_checkpointing = False

    def __init__(self, config: Qwen3Config, layer_idx: int, shift: nn.Module | None = None) -> None:
        super().__init__()
        self.shift = shift
        self.self_attn = QKNormAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | BlockMask | None = None,
        cache: Cache | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Shape: hidden_states (B, ..., H) whose middle axes are the Q query positions in order (DFlash (B, Q, H),
        SpecBlock (B, N, K, H)) → the same shape; the other inputs as :meth:`QKNormAttention.forward` takes them.
        Only the queries take the residual path and the norms: a context was normalised by the caller."""
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return self._layer(hidden_states, position_embeddings, attention_mask, context, cache=cache)[0]
        past = cached_keys(cache, self.self_attn.layer_idx)
        # Tensors that may need gradients go positionally (a reentrant checkpoint passes gradients only to those).
        cos, sin = position_embeddings
        hidden_states, key, value = self._gradient_checkpointing_func(
            self._replayed, hidden_states, cos, sin, attention_mask, context, *(past or (None, None))
        )
        if cache is not None:
            cache.update(key, value, self.self_attn.layer_idx)
        return hidden_states

    def _replayed(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | BlockMask | None,
        context: torch.Tensor | None,
        past_keys: torch.Tensor | None,
        past_values: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The checkpointed part: no side effect, the cached keys given as tensors."""
        past = None if past_keys is None else (past_keys, past_values)
        return self._layer(hidden_states, (cos, sin), attention_mask, context, past=past)

    def _layer(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | BlockMask | None,
        context: torch.Tensor | None,
        cache: Cache | None = None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer over the cached keys of ``cache`` (written here) or ``past`` (not written); returns the output
        and this call's new keys and values. Shape: (B, ..., H) → same, (B, kv_heads, C + Q, D) twice."""
        if self.shift is not None:
            hidden_states = self.shift(hidden_states)
        # Shape: (B, Q, H)
        flat = hidden_states.flatten(1, -2)
        attn = self.self_attn
        query, new_keys, new_values = attn.project(self.input_layernorm(flat), context, position_embeddings)
        key, value = new_keys, new_values
        if cache is not None:
            # Shape: (B, kv_heads, P + C + Q, D): rotated keys are cached, so a key keeps its position for good.
            key, value = cache.update(key, value, attn.layer_idx)
        elif past is not None:
            key, value = torch.cat([past[0], key], dim=-2), torch.cat([past[1], value], dim=-2)
        flat = flat + attn.attend(query, key, value, attention_mask)
        flat = flat + self.mlp(self.post_attention_layernorm(flat))
        return flat.view(hidden_states.shape), new_keys, new_values
