"""DFlash block drafter (docs/algorithms.md §1): a few Qwen3 decoder layers that draft a whole block in one forward.

The drafter reads the frozen target's hidden states of a few layers (``target_layer_ids``), projects their
concatenation to one context vector per committed position (``hidden_norm(fc(.))``), and runs a block of
``block_size`` query positions - the last committed token followed by ``MASK`` tokens, embedded with the target's
own input embedding - through decoder layers whose keys and values come from ``concat[context, block]``. No
causal mask: the block sees all of its context and itself bidirectionally. The output is the final-normed
hidden state per block slot; the target's frozen LM head turns it into logits. The drafter owns no embedding
and no LM head.

Parameter names equal the keys of the reference checkpoint format (``z-lab/Qwen3-4B-DFlash-b16``, loaded by
``DFlashDraftModel`` of the ``dflash`` package), and ``config.json`` is a Qwen3 config plus ``block_size``,
``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``, so a directory written by
``save_pretrained`` loads in the reference and the other way round.

On CPU, with a config-built Qwen3 target::

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trainer.drafters.dflash import DFlashDraftModel, build_config

    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8)).eval()
    drafter = DFlashDraftModel(build_config(target.config, num_layers=2, block_size=4, mask_token_id=96))
    ids = torch.randint(0, 96, (1, 10))
    hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i + 1] for i in drafter.target_layer_ids], dim=-1)   # (1, 10, 2*32)
    block = torch.tensor([[ids[0, -1].item()] + [96] * 3])                             # anchor, then MASK
    out = drafter(target.get_input_embeddings()(block), features[:, :-1], torch.arange(13)[None])
    draft = target.lm_head(out)[:, 1:].argmax(-1)                                     # slots 1..3
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import PretrainedConfig, Qwen3Config
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding

from trainer.drafters.attention import MaskRule, additive_mask, as_rule, window_rule
from trainer.drafters.common import DrafterDecoderLayer, SdpaDrafter, drafter_config, valid_layer_ids
from trainer.errors import UserError

DEFAULT_BLOCK_SIZE = 16


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers whose outputs feed the drafter: one per drafter layer, spread over the target's depth.

    One drafter layer reads the middle layer; more read ``round(1 + i * (L - 4) / (n - 1))``, i.e. evenly from
    layer 1 to layer ``L - 3`` (36 target layers, 5 drafter layers: ``[1, 9, 17, 25, 33]``). Layer id ``l`` is
    the output of decoder layer ``l``, HF ``hidden_states[l + 1]``.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise UserError(
            f"default_target_layer_ids needs at least one target and one drafter layer, got {num_target_layers} target "
            f"and {num_draft_layers} drafter layers"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def build_config(
    target_config: PretrainedConfig,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: Sequence[int] | None = None,
    **overrides: Any,
) -> Qwen3Config:
    """A drafter config for ``target_config``: the target's width, heads, RoPE, vocabulary and norm eps.

    The drafter's hidden size must equal the target's, because its inputs are the target's input embeddings
    and its outputs go through the target's LM head; every other field (e.g. ``intermediate_size``) may be
    overridden. ``target_layer_ids`` defaults to the spread rule of :func:`default_target_layer_ids`.
    """
    text = target_config.get_text_config()
    num_target_layers = text.num_hidden_layers
    if num_layers < 1:
        raise UserError(f"a DFlash drafter needs at least one layer, got num_layers={num_layers}")
    if block_size < 2:
        raise UserError(f"block_size must be at least 2 (the anchor plus one drafted slot), got {block_size}")
    if not 0 <= mask_token_id < text.vocab_size:
        raise UserError(f"mask_token_id {mask_token_id} is outside the target vocabulary 0..{text.vocab_size - 1}")
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    fields = {
        # The reference format: top-level block size and target depth, the rest under `dflash_config`.
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": valid_layer_ids(target_layer_ids, num_target_layers),
        },
        "architectures": ["DFlashDraftModel"],
    }
    return drafter_config(Qwen3Config, text, num_layers, fields, overrides)


LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(config: PretrainedConfig) -> list[str]:
    """The type of each layer (``full_attention`` unless ``layer_types`` says otherwise), refused unless every
    one is bidirectional full attention or a sliding window (causal in its block, as speculators writes such
    layers) with a positive ``sliding_window``, and ``is_causal`` is unset."""
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    problems = []
    if len(layer_types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in layer_types):
        problems.append(f"layer_types={layer_types} must name {config.num_hidden_layers} of {LAYER_TYPES}")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        problems.append(f"sliding layers need a positive sliding_window, got {window}")
    if getattr(config, "is_causal", None) is not None:
        problems.append(f"is_causal={config.is_causal} is not supported (full layers are bidirectional)")
    if problems:
        raise UserError(f"DFlashDraftModel cannot load this config: {'; '.join(problems)}")
    return layer_types


def _dflash_field(config: PretrainedConfig, name: str, default: Any = None) -> Any:
    """A DFlash setting: from ``dflash_config`` first, then the config's top level (where the reference looks)."""
    nested = getattr(config, "dflash_config", None) or {}
    return nested.get(name, getattr(config, name, default))


class DFlashDraftModel(SdpaDrafter, Qwen3PreTrainedModel):
    """The DFlash drafter: ``fc`` + ``hidden_norm`` over target features, Qwen3-style layers, final ``norm``."""

    # The main input is the block's embeddings (taken from the target), not token ids: the drafter has no
    # embedding table for activation checkpointing to hook.
    main_input_name = "noise_embedding"
    _no_split_modules: ClassVar[list[str]] = ["DrafterDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.layer_types = check_layer_types(config)
        self.target_layer_ids: list[int] = list(
            _dflash_field(
                config,
                "target_layer_ids",
                default_target_layer_ids(config.num_target_layers, config.num_hidden_layers),
            )
        )
        self.block_size = int(_dflash_field(config, "block_size", DEFAULT_BLOCK_SIZE))
        self.mask_token_id: int | None = _dflash_field(config, "mask_token_id")

        hidden = config.hidden_size
        self.layers = nn.ModuleList(DrafterDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        # [H, n*H]: the concatenated target features of all n chosen layers to one context vector per position.
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | MaskRule | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        return_prenorm: bool = False,
    ) -> torch.Tensor:
        """Draft hidden states for the query positions, after the final ``norm``. Shape: (B, Q, H).

        - ``noise_embedding`` (B, Q, H): the target's input embeddings of the block tokens (anchor, MASK, ...);
          in training, several blocks concatenated along Q.
        - ``target_hidden`` (B, C, n*H): the raw concatenated target features of the context positions whose
          keys are not cached yet; ``hidden_norm(fc(.))`` is applied here.
        - ``position_ids`` (B, C + Q): the context positions, then the query positions. Keys take all of
          them, queries the last Q.
        - ``attention_mask``: ``None`` lets every query see every key (inference: one block after its context),
          or a mask (B, 1, Q, P + C + Q) over the P cached and C + Q new keys, additive float (``0`` /
          ``finfo.min``) or boolean (``True`` = may attend), or a :class:`~trainer.drafters.attention.MaskRule`
          built for ``self.attention`` (training: :func:`trainer.training.blocks.block_mask_rule`). It is
          the full-attention layers' mask; sliding-window layers see its intersection with
          :func:`~trainer.drafters.attention.window_rule`, whose cached keys hold positions ``0..P-1``.
        - ``past_key_values``: a ``DynamicCache`` (built from :attr:`cache_config`) that receives the new context
          and block keys of every layer and supplies the cached ones. Keep the context, drop the block after drafting:
          ``past_key_values.crop(-Q)`` (transformers 5.24 takes the negative count to remove).
        - ``use_cache``: must be set with a cache (a cache passed in is always updated, as in the reference);
          without one there is nowhere to keep the keys, since the drafter returns only hidden states.
        - ``return_prenorm``: return the last layer's output before ``norm`` (TreeFlash corrects that ``h`` and
          normalises afterwards); ``self.norm`` of it is the default output.
        """
        if use_cache and past_key_values is None:
            raise ValueError("use_cache=True needs a DynamicCache in past_key_values: the drafter returns only states")
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features; expected {self.fc.in_features} "
                f"(the {len(self.target_layer_ids)} target layers {self.target_layer_ids} concatenated)"
            )
        q_len, ctx_len = noise_embedding.shape[1], target_hidden.shape[1]
        if position_ids.shape[-1] != ctx_len + q_len:
            raise ValueError(
                f"position_ids must cover the {ctx_len} context then the {q_len} query positions, "
                f"got {position_ids.shape[-1]}"
            )

        # Shape: (B, C, H)
        context = self.hidden_norm(self.fc(target_hidden))
        hidden_states = noise_embedding
        # Shape: cos, sin (B, C + Q, D)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        masks = self.layer_masks(attention_mask, position_ids, cached, q_len, hidden_states.dtype)

        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            # Tensors that may need gradients go positionally, as gradient checkpointing requires.
            hidden_states = layer(hidden_states, position_embeddings, masks[layer_type], past_key_values, context)
        return hidden_states if return_prenorm else self.norm(hidden_states)

    @property
    def cache_config(self) -> Qwen3Config:
        """The config to build this drafter's KV caches from: every layer a full one. Sliding layers apply their
        window through the mask (:meth:`layer_masks`), which needs every cached key at its position; a
        sliding-window cache layer would drop keys and break that."""
        config = copy.deepcopy(self.config)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        return config

    def layer_masks(
        self,
        attention_mask: torch.Tensor | MaskRule | None,
        position_ids: torch.Tensor,
        cached: int,
        q_len: int,
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor | BlockMask | None]:
        """The mask of each layer type (see :meth:`forward`): a rule is built for ``self.attention``, an explicit
        mask or ``None`` (decoding) stays dense."""
        rule = attention_mask if isinstance(attention_mask, MaskRule) else None
        if rule is not None:
            full = rule.build(self.attention, dtype)
        else:
            full = None if attention_mask is None else additive_mask(attention_mask, dtype)
        masks: dict[str, torch.Tensor | BlockMask | None] = {"full_attention": full}
        if "sliding_attention" in self.layer_types:
            batch, device = position_ids.shape[0], position_ids.device
            key_positions = torch.cat([torch.arange(cached, device=device).expand(batch, -1), position_ids], dim=1)
            window = window_rule(position_ids[:, -q_len:], key_positions, self.block_size, self.config.sliding_window)
            if rule is None:
                rule = as_rule(attention_mask, batch, q_len, key_positions.shape[1], device)
                masks["sliding_attention"] = (rule & window).build("dense", dtype)
            else:
                masks["sliding_attention"] = (rule & window).build(self.attention, dtype)
        return masks
