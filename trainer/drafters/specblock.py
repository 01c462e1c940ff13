"""SpecBlock block-iterative drafter (docs/algorithms.md §5): one forward drafts a block of K dependent slots.

A block starts from a token and a condition vector (the projected target features of three layers, or an earlier
slot's state for a block launched from it); slot ``k`` predicts the token ``k + 1`` after it. A layer-wise shift
hands each slot the previous slot's state before every decoder layer but the first, so slot ``k`` depends only on
slots ``< k``; a rank head predicts the target token's rank class in the draft distribution. Inputs, attention
pattern, cross-block launches and a runnable CPU example with a ``DynamicCache``: docs/specblock.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, Qwen3Config
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding

from trainer.drafters.attention import MaskRule, additive_mask, context_rule, launch_rule
from trainer.drafters.common import (
    DrafterDecoderLayer,
    DraftVocabHead,
    SdpaDrafter,
    drafter_config,
    eagle3_layer_ids,
    valid_layer_ids,
)
from trainer.errors import UserError

DEFAULT_BLOCK_SIZE = 4
# Upper ranks of the rank classes but the last: class 0 = rank 1, 1 = ranks 2-4, 2 = ranks 5-10, 3 = above 10.
RANK_CLASS_BOUNDS = (1, 4, 10)
# The rank head reads this many top log-probs, and the gaps from the top-1 to these ranks (1-based).
RANK_TOPK = 10
RANK_GAP_RANKS = (2, 3, 5)
DEFAULT_RANK_HIDDEN_SIZE = 256
# How a context position's features pair with a token (module docstring): the authors' ``next``, or ``same``.
ALIGNMENTS = ("next", "same")


def build_config(
    target_config: PretrainedConfig,
    num_layers: int = 2,
    block_size: int = DEFAULT_BLOCK_SIZE,
    target_layer_ids: Sequence[int] | None = None,
    rank_hidden_size: int = DEFAULT_RANK_HIDDEN_SIZE,
    alignment: str = "next",
    draft_vocab_size: int | None = None,
    **overrides: Any,
) -> Qwen3Config:
    """A drafter config for ``target_config``: the target's width, heads, RoPE, vocabulary and norm eps.

    The hidden size must equal the target's (the drafter reads its input embeddings and feeds its LM head);
    other fields (e.g. ``intermediate_size``) may be overridden. SpecBlock's own settings go under
    ``specblock_config: {block_size, target_layer_ids, rank_class_bounds, rank_hidden_size, alignment,
    draft_vocab_size}``; ``draft_vocab_size`` ``None`` drafts through the target's frozen LM head.
    """
    text = target_config.get_text_config()
    num_target_layers = text.num_hidden_layers
    if num_layers < 1:
        raise UserError(f"a SpecBlock drafter needs at least one layer, got num_layers={num_layers}")
    if block_size < 1:
        raise UserError(f"block_size must be at least 1, got {block_size}")
    if rank_hidden_size < 1:
        raise UserError(f"rank_hidden_size must be at least 1, got {rank_hidden_size}")
    if text.vocab_size < RANK_TOPK:
        raise UserError(f"the rank head reads the top-{RANK_TOPK} log-probs; the vocabulary has {text.vocab_size}")
    if alignment not in ALIGNMENTS:
        raise UserError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if draft_vocab_size is not None and not RANK_TOPK <= draft_vocab_size <= text.vocab_size:
        raise UserError(
            f"draft_vocab_size must be within {RANK_TOPK}..{text.vocab_size} (the target's vocabulary), "
            f"got {draft_vocab_size}"
        )
    if target_layer_ids is None:
        target_layer_ids = eagle3_layer_ids(num_target_layers, "SpecBlock")
    fields = {
        "num_target_layers": num_target_layers,
        "specblock_config": {
            "block_size": block_size,
            "target_layer_ids": valid_layer_ids(target_layer_ids, num_target_layers),
            "rank_class_bounds": list(RANK_CLASS_BOUNDS),
            "rank_hidden_size": rank_hidden_size,
            "alignment": alignment,
            "draft_vocab_size": draft_vocab_size,
        },
        "architectures": ["SpecBlockDraftModel"],
    }
    return drafter_config(Qwen3Config, text, num_layers, fields, overrides)


# ---- attention patterns (pure functions; True = may attend) ---------------------------------------------------
def context_mask(doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Shape: doc_ids (B, T) → bool (B, T·K, T·K): :func:`trainer.drafters.attention.context_rule` dense."""
    return context_rule(doc_ids, block_size).dense()[:, 0]


def launch_mask(visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """Shape: visible (B, N, P) bool → bool (B, 1, N·K, P + N·K): :func:`trainer.drafters.attention.launch_rule`
    dense (N blocks launched in one call, each seeing its visible cached keys and its own slots causally)."""
    return launch_rule(visible, block_size).dense()


# ---- rank classes ------------------------------------------------------------------------------------------------
def token_rank(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """1-based rank of ``token`` in each distribution (ties rank in the token's favour).

    Shape: logits (..., V), token (...) → (...) long.
    """
    own = logits.gather(-1, token[..., None])
    return (logits > own).sum(-1) + 1


def rank_class(rank: torch.Tensor, bounds: Sequence[int] = RANK_CLASS_BOUNDS) -> torch.Tensor:
    """Class of a 1-based rank: the number of bounds below it (default: 1 → 0, 2-4 → 1, 5-10 → 2, >10 → 3)."""
    edges = torch.tensor(list(bounds), device=rank.device, dtype=rank.dtype)
    return torch.bucketize(rank, edges, right=False)


def rank_features(normed_hidden: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """The rank head's input, detached. Shape: (..., H), (..., V) log-softmaxed → (..., H + 15)."""
    logprobs = logprobs.detach().float()
    top = logprobs.topk(RANK_TOPK, dim=-1).values
    gaps = top[..., :1] - top[..., [r - 1 for r in RANK_GAP_RANKS]]
    entropy = -(logprobs.exp() * logprobs).sum(-1, keepdim=True)
    return torch.cat([normed_hidden.detach().float(), top, gaps, top[..., :1].exp(), entropy], dim=-1)


# ---- modules -----------------------------------------------------------------------------------------------------
class LayerShift(nn.Linear):
    """``S_l``: ``h <- S_l(concat[h, shift(h)])``, ``shift(h)[k] = h[k-1]`` within a block, ``shift(h)[0] = h[0]``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(2 * hidden_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Shape: (B, N, K, H) -> (B, N, K, H)
        shifted = torch.cat([hidden[:, :, :1], hidden[:, :, :-1]], dim=2)
        return super().forward(torch.cat([hidden, shifted], dim=-1))


class RankHead(nn.Module):
    """MLP over :func:`rank_features` → logits of the rank classes."""

    def __init__(self, in_features: int, hidden_size: int, num_classes: int) -> None:
        super().__init__()
        self.up = nn.Linear(in_features, hidden_size)
        self.out = nn.Linear(hidden_size, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.up(features)))


class SpecBlockDraftModel(SdpaDrafter, DraftVocabHead, Qwen3PreTrainedModel):
    """The SpecBlock drafter: condition/token/slot-query fusion, shifted Qwen3-style layers, ``norm``, an optional
    draft-vocabulary ``lm_head``, rank head."""

    main_input_name = "condition"
    _no_split_modules: ClassVar[list[str]] = ["DrafterDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        spec = getattr(config, "specblock_config", None)
        if not spec:
            raise UserError("the config has no specblock_config; build it with trainer.drafters.specblock.build_config")
        self.block_size = int(spec["block_size"])
        self.target_layer_ids: list[int] = [int(i) for i in spec["target_layer_ids"]]
        self.rank_class_bounds: list[int] = [int(b) for b in spec["rank_class_bounds"]]
        # Absent from a config, these mean: f_i pairs with x_i, and drafts go through the target's head.
        self.alignment: str = spec.get("alignment", "same")
        self.draft_vocab_size: int | None = spec.get("draft_vocab_size")
        hidden = config.hidden_size

        self.condition_proj = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.condition_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.token_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.query_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.slot_queries = nn.Parameter(torch.empty(self.block_size, hidden))
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        # Layers after the first open with a layer shift.
        self.layers = nn.ModuleList(
            DrafterDecoderLayer(config, i, LayerShift(hidden) if i > 0 else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False) if self.draft_vocab_size else None
        if self.draft_vocab_size:
            self.register_draft_vocab(config.vocab_size, self.draft_vocab_size)
        self.rank_head = RankHead(
            hidden + RANK_TOPK + len(RANK_GAP_RANKS) + 2, int(spec["rank_hidden_size"]), len(self.rank_class_bounds) + 1
        )
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LayerShift):
            # S_l starts as the identity on h (the shifted half at zero): a fresh model is a plain decoder stack
            # whose residual stream is not rescaled by a random 2H -> H map.
            h = module.out_features
            identity = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
            init.copy_(module.weight, identity.to(device=module.weight.device, dtype=module.weight.dtype))
        elif isinstance(module, SpecBlockDraftModel):
            init.normal_(module.slot_queries, std=self.config.initializer_range)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """``P f``: the condition of context blocks. Shape: (B, N, n_layers·H) → (B, N, H)."""
        if features.shape[-1] != self.condition_proj.in_features:
            raise ValueError(
                f"features have {features.shape[-1]} channels; expected {self.condition_proj.in_features} "
                f"(the {len(self.target_layer_ids)} target layers {self.target_layer_ids} concatenated)"
            )
        return self.condition_proj(features)

    def forward(
        self,
        condition: torch.Tensor,
        token_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | MaskRule | None = None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        """Pre-norm hidden states of every slot of N blocks. Shape: (B, N, K, H).

        - ``condition`` (B, N, H): per block, ``project_features(f_s)`` for a context position, or the pre-norm
          hidden state of the slot a cross-block starts from (``condition_norm`` is applied here).
        - ``token_embedding`` (B, N, H): the target's input embedding of each block's token ``x_s``.
        - ``position_ids`` (B, N): the position ``s`` of each block's token; slot ``k`` sits at ``s + 1 + k``.
        - ``attention_mask``: (B, 1, N·K, P + N·K) over the P cached and the N·K new keys, boolean
          (``True`` = may attend) or additive float (``0`` / ``finfo.min``), or a
          :class:`~trainer.drafters.attention.MaskRule` built for ``self.attention``; see :func:`context_mask` and
          :func:`launch_mask` (training: their rules). ``None``: the N blocks are consecutive context positions
          of one sequence that see every cached key (feeding a context in pieces).
        - ``past_key_values``: a ``DynamicCache(config=model.config)`` that receives the new keys of every layer
          and supplies the cached ones; ``crop(-n)`` removes the last n keys.
        """
        b, n, hidden = condition.shape
        k = self.block_size
        if token_embedding.shape != condition.shape or position_ids.shape != (b, n):
            raise ValueError(
                f"condition {tuple(condition.shape)}, token_embedding {tuple(token_embedding.shape)} and "
                f"position_ids {tuple(position_ids.shape)} must describe the same (B, N) blocks"
            )
        cached = past_key_values.get_seq_length(0) if past_key_values is not None else 0
        if attention_mask is None:
            own = context_mask(torch.ones(1, n, dtype=torch.long, device=condition.device), k)
            seen = torch.ones(1, n * k, cached, dtype=torch.bool, device=condition.device)
            attention_mask = torch.cat([seen, own], dim=-1)[:, None]
        covers = (
            (attention_mask.q_len, attention_mask.kv_len)
            if isinstance(attention_mask, MaskRule)
            else tuple(attention_mask.shape[-2:])
        )
        if covers != (n * k, cached + n * k):
            raise ValueError(
                f"attention_mask covers {covers} (queries, keys); expected "
                f"({n * k}, {cached + n * k}) for {n} blocks of {k} slots after {cached} cached keys"
            )
        dtype = self.fuse.weight.dtype
        if isinstance(attention_mask, MaskRule):
            attention_mask = attention_mask.build(self.attention, dtype)
        else:
            attention_mask = additive_mask(attention_mask, dtype)

        # fuse(concat[c, t, q]) is the sum of three H -> H maps; the condition and the token are per block and
        # the slot query per slot, so they are mapped on N and K rows and broadcast, not on N·K rows of 3H.
        # Shape: (H, H) each
        w_condition, w_token, w_query = self.fuse.weight.split(hidden, dim=1)
        # Shape: (B, N, H) + (B, N, H) -> (B, N, 1, H); (K, H); sum (B, N, K, H)
        per_block = F.linear(self.condition_norm(condition).to(dtype), w_condition) + F.linear(
            self.token_norm(token_embedding).to(dtype), w_token
        )
        per_slot = F.linear(self.query_norm(self.slot_queries).to(dtype), w_query)
        hidden_states = per_block[:, :, None] + per_slot
        # Shape: (B, N·K) slot positions s + 1 + k; cos, sin (B, N·K, D)
        slot_positions = (position_ids[..., None] + 1 + torch.arange(k, device=position_ids.device)).flatten(1)
        position_embeddings = self.rotary_emb(hidden_states, slot_positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, past_key_values)
        return hidden_states

    @property
    def token_shift(self) -> int:
        """Row offset from a context position to its block's token: 1 for ``next``, 0 for ``same``."""
        return 1 if self.alignment == "next" else 0

    def logits(self, normed_hidden: torch.Tensor, target_head: nn.Module) -> torch.Tensor:
        """Draft logits: over the draft vocabulary with the own ``lm_head``, else over the target's with
        ``target_head`` (the target's frozen LM head). Shape: (..., H) → (..., draft_vocab_size or V)."""
        head = self.lm_head if self.lm_head is not None else target_head
        return head(normed_hidden)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (the identity without an own head). Shape: any → same."""
        return super().to_target(draft_ids) if self.lm_head is not None else draft_ids

    def rank_logits(self, normed_hidden: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Rank-class logits (class c: the target token's rank is within ``rank_class_bounds``' c-th bracket).

        Shape: normed_hidden (..., H) = ``norm(forward(...))``, logprobs (..., V) log-softmaxed draft
        distribution → (..., len(rank_class_bounds) + 1). Inputs are detached: the head never shapes the drafts.
        """
        features = rank_features(normed_hidden, logprobs)
        return self.rank_head(features.to(self.rank_head.up.weight.dtype))
