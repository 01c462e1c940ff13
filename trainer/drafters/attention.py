"""The drafters' attention: training masks as predicates, run densely (SDPA) or as flex attention block masks.

A training batch attends through patterns that are far larger than their description: DFlash's ``N·K`` block
queries over ``T + N·K`` keys (``dflash_qwen3_4b``: 512 anchors x 16 slots, 3072 tokens, so a float32 mask of
369 MB per row), SpecBlock's ``T·K`` context slots over themselves, EAGLE-3's unrolled steps. Each pattern lives
here once, as a :class:`MaskRule`: a boolean predicate over (batch, query, key) indices that reads a few small
per-row tensors. A rule runs one of two ways (:data:`AttentionPath`):

- ``dense``: the predicate evaluated on the full index grid, an additive float mask given to SDPA (the
  reference: every kernel on every device; the mask's memory grows with queries x keys);
- ``flex``: a block mask of the same predicate (``torch.nn.attention.flex_attention.create_block_mask``: two
  int32 entries per 128 x 128 tile; the boolean grid exists only while it is built) and ``flex_attention``,
  compiled on CUDA, which skips empty tiles and evaluates the predicate inside partial ones.

``auto`` (the default) is ``flex`` on CUDA and ``dense`` elsewhere: torch's flex attention has no backward on
CPU, and uncompiled it materialises the scores anyway. Decoding passes small explicit masks (or none) and
always runs SDPA, with boolean masks made additive by ``additive_mask``.

On CPU::

    python -c "from trainer.drafters.attention import describe_4b; print(describe_4b())"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Literal, get_args

import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from trainer.errors import UserError


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as an additive mask in ``dtype``: ``0`` where a query may attend a key,
    ``finfo(dtype).min`` where it may not. A float mask is already additive and only moved into ``dtype``'s range
    (``finfo(float32).min`` would overflow to -inf in float16). Shape: any → the same.

    HF attention adds a float mask to the scores, and a boolean one is silently wrong with eager attention (which
    adds it), so every dense mask of the package (packed samples, training blocks, the training-time test, draft
    and verification trees) is built as a boolean "allowed" tensor and turned into this form here."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype).clamp_min(torch.finfo(dtype).min)


AttentionPath = Literal["auto", "flex", "dense"]
ATTENTION_PATHS: tuple[str, ...] = get_args(AttentionPath)

# (batch, query, key) index tensors → bool "may attend". Under flex each is a 0-d tensor (vmapped); densely
# they broadcast to (B, Q, KV). Per-row tensors are read by indexing, so both evaluations share one body.
Predicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Set only inside `dense_attention()`: every rule then builds the dense mask, whatever its path says.
_forced_dense = False


@contextmanager
def dense_attention() -> Iterator[None]:
    """Within this block every training mask runs the dense path. For ``torch.utils.flop_counter``, which cannot
    trace the compiled flex kernel: a benchmark counts a step's FLOPs densely (the count a dense kernel does, masked
    positions included) and times the other steps on the path the recipe chose."""
    global _forced_dense
    outer, _forced_dense = _forced_dense, True
    try:
        yield
    finally:
        _forced_dense = outer


def resolve_path(path: str, device: torch.device) -> Literal["flex", "dense"]:
    """``auto`` → ``flex`` on CUDA, ``dense`` elsewhere; ``flex`` and ``dense`` as given; anything else refused."""
    if path not in ATTENTION_PATHS:
        raise UserError(f"attention must be one of {', '.join(ATTENTION_PATHS)}; got {path!r}")
    if _forced_dense:
        return "dense"
    if path == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return path  # type: ignore[return-value]


class MaskRule:
    """An attention pattern of ``batch`` rows, ``q_len`` queries and ``kv_len`` keys, as a predicate."""

    def __init__(self, predicate: Predicate, batch: int, q_len: int, kv_len: int, device: torch.device) -> None:
        self.predicate = predicate
        self.batch, self.q_len, self.kv_len = batch, q_len, kv_len
        self.device = device

    def __and__(self, other: MaskRule) -> MaskRule:
        if (self.batch, self.q_len, self.kv_len) != (other.batch, other.q_len, other.kv_len):
            raise ValueError(
                f"cannot intersect masks of (rows, queries, keys) {(self.batch, self.q_len, self.kv_len)} and "
                f"{(other.batch, other.q_len, other.kv_len)}"
            )
        first, second = self.predicate, other.predicate
        return MaskRule(
            lambda b, q, k: first(b, q, k) & second(b, q, k), self.batch, self.q_len, self.kv_len, self.device
        )

    def dense(self) -> torch.Tensor:
        """The predicate on the full grid. Shape: (B, 1, Q, KV) bool."""
        arange = lambda n: torch.arange(n, device=self.device)  # noqa: E731
        b = arange(self.batch)[:, None, None]
        q = arange(self.q_len)[None, :, None]
        k = arange(self.kv_len)[None, None, :]
        allowed = self.predicate(b, q, k)
        return allowed.expand(self.batch, self.q_len, self.kv_len)[:, None]

    def block_mask(self) -> BlockMask:
        """The flex attention block mask of the predicate (shared by every head)."""
        predicate = self.predicate
        # Built uncompiled, from the full (Q, KV) grid of the predicate: on an H200, compiling create_block_mask
        # took ~3 minutes at dflash_qwen3_4b's shapes (and ~10 s per new shape) to save ~4 ms of a 120 ms step.
        return create_block_mask(
            lambda b, h, q, k: predicate(b, q, k), self.batch, None, self.q_len, self.kv_len, device=self.device
        )

    def build(self, path: str, dtype: torch.dtype) -> torch.Tensor | BlockMask:
        """What the attention layers take: an additive ``dtype`` mask (B, 1, Q, KV) or a block mask."""
        if resolve_path(path, self.device) == "flex":
            return self.block_mask()
        return additive_mask(self.dense(), dtype)


def as_rule(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device: torch.device) -> MaskRule:
    """A dense mask (bool, or additive float: ``0`` = may attend) of shape (B or 1, 1, Q, KV), or ``None`` (every
    key), as a rule, to intersect with another rule."""
    if mask is None:
        return MaskRule(lambda b, q, k: torch.ones((), dtype=torch.bool, device=device), batch, q_len, kv_len, device)
    allowed = (mask if mask.dtype == torch.bool else mask == 0)[:, 0].expand(batch, q_len, kv_len)
    return MaskRule(lambda b, q, k: allowed[b, q, k], batch, q_len, kv_len, device)


# ---- the training patterns (True = may attend) ----------------------------------------------------------------
def block_rule(doc_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int) -> MaskRule:
    """DFlash / TreeFlash training: doc_ids (B, T), anchors and valid (B, N) → (B, N·K queries, T + N·K keys).

    Query slot of block n sees context key j iff ``j < a_n`` and j is in the anchor's sample, and every slot of
    block n (bidirectionally). Invalid (padding) blocks see only their own block, so no row is empty.
    """
    batch, t = doc_ids.shape
    n = anchors.shape[1]
    a = anchors.clamp(min=0)
    # Shape: (B, N) each
    anchor_doc = doc_ids.gather(1, a)

    def predicate(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        block = q // block_size
        j = k.clamp(max=t - 1)
        context = (k < t) & (j < a[b, block]) & (doc_ids[b, j] == anchor_doc[b, block]) & valid[b, block]
        own = (k >= t) & ((k - t) // block_size == block)
        return context | own

    return MaskRule(predicate, batch, n * block_size, t + n * block_size, doc_ids.device)


def window_rule(query_positions: torch.Tensor, key_positions: torch.Tensor, block_size: int, window: int) -> MaskRule:
    """The sliding-window restriction of a DFlash layer: query_positions (B, Q) of blocks of ``block_size``
    consecutive slots (one block may be shorter, in decoding), key_positions (B, KV) → (B, Q, KV).

    A slot sees keys at positions ``p`` with ``a - window <= p <= its own``, ``a`` its block's anchor (slot 0):
    causal inside the block, the context window counted from the anchor, as speculators trains such layers.
    Intersect it with the full-attention rule, which keeps each block to its own sample and slots.
    """
    batch, q_len = query_positions.shape
    anchor_positions = query_positions - torch.arange(q_len, device=query_positions.device) % block_size

    def predicate(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        p = key_positions[b, k]
        return (p <= query_positions[b, q]) & (p >= anchor_positions[b, q] - window)

    return MaskRule(predicate, batch, q_len, key_positions.shape[1], query_positions.device)


def packed_causal_rule(doc_ids: torch.Tensor, steps: int = 1) -> MaskRule:
    """Packed causal attention, with EAGLE-3's unrolled steps: doc_ids (B, T) → (B, T, steps·T), keys of steps
    ``0..steps-1`` in order. Step 0 keys: causal within the query's sample (padding sees only itself). Keys of
    later steps: only the query's own origin position."""
    batch, t = doc_ids.shape

    def predicate(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        j = k % t
        committed = (k < t) & (j <= q) & (doc_ids[b, j] == doc_ids[b, q]) & (doc_ids[b, q] > 0)
        # Every query sees its own origin: no row is empty (SDPA would give NaN).
        return committed | (j == q)

    return MaskRule(predicate, batch, t, steps * t, doc_ids.device)


def context_rule(doc_ids: torch.Tensor, block_size: int) -> MaskRule:
    """SpecBlock's context blocks: doc_ids (B, T) → (B, T·K, T·K), slot-major per position.

    Query slot ``(i, k)`` sees key slot ``(j, m)`` iff both positions are in the same packed sample and
    ``j < i``, or ``j == i`` and ``m <= k``. Padding (``doc_ids == 0``) sees only its own slots ``<= k``.
    """
    batch, t = doc_ids.shape

    def predicate(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        i, j = q // block_size, k // block_size
        earlier = (j < i) & (doc_ids[b, j] == doc_ids[b, i]) & (doc_ids[b, i] > 0)
        return earlier | ((j == i) & (k % block_size <= q % block_size))

    return MaskRule(predicate, batch, t * block_size, t * block_size, doc_ids.device)


def launch_rule(visible: torch.Tensor, block_size: int) -> MaskRule:
    """SpecBlock's launched blocks: visible (B, N, P) bool → (B, N·K, P + N·K): N blocks in one call.

    Block ``n`` sees the cached keys ``visible[b, n]`` (its context and ancestors) and its own slots causally
    (slot ``k`` sees slots ``<= k``); blocks of one call never see each other.
    """
    batch, n, p = visible.shape

    def predicate(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        block = q // block_size
        cached = (k < p) & visible[b, block, k.clamp(max=max(p - 1, 0))] if p else torch.zeros_like(k < 0)
        own = (k >= p) & ((k - p) // block_size == block) & ((k - p) % block_size <= q % block_size)
        return cached | own

    return MaskRule(predicate, batch, n * block_size, p + n * block_size, visible.device)


# ---- attention -------------------------------------------------------------------------------------------------
@cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    # One compiled kernel per process: torch.compile caches its graphs per shape on this object.
    return torch.compile(flex_attention)


def _forward_only_flex(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    if torch.is_grad_enabled() and query.requires_grad:
        raise UserError(
            f"attention: flex cannot train on {query.device.type} (torch's flex attention has no backward there); "
            "use attention: dense, or auto (flex on CUDA, dense elsewhere)"
        )
    return flex_attention(query, *args, **kwargs)


def flex_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The flex attention callable for ``device``: compiled on CUDA (the fused kernel); elsewhere torch's
    unfused implementation, forward only."""
    return _compiled_flex() if device.type == "cuda" else _forward_only_flex


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | BlockMask | None,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Grouped-query attention: query (B, heads, Q, D), key and value (B, kv_heads, KV, D) → (B, heads, Q, D).

    ``mask``: an additive float mask (B or 1, 1, Q, KV) or ``None`` (every key) runs SDPA; a block mask runs
    flex attention (no dropout there)."""
    if isinstance(mask, BlockMask):
        if dropout_p:
            raise UserError(f"flex attention has no dropout; attention_dropout={dropout_p} needs attention: dense")
        return flex_kernel(query.device)(query, key, value, block_mask=mask, scale=scale, enable_gqa=True)
    # Each key/value head serves `heads / kv_heads` query heads.
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def mask_bytes(mask: torch.Tensor | BlockMask | None) -> int:
    """Bytes a built mask holds: a dense mask's elements, or every index tensor of a block mask."""
    if mask is None:
        return 0
    if isinstance(mask, torch.Tensor):
        return mask.numel() * mask.element_size()
    tensors = [x for x in mask.as_tuple() if isinstance(x, torch.Tensor)]
    return sum(x.numel() * x.element_size() for x in tensors)


def mask_memory(
    tokens: int,
    anchors: int,
    block_size: int,
    path: str,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict[str, int | None]:
    """The DFlash training mask of one row (``tokens`` positions of one sample, ``anchors`` blocks of
    ``block_size``) built on ``path``: ``held``, the bytes the built mask keeps through the forward, and ``peak``,
    the most memory building it took on CUDA (``None`` elsewhere: torch counts allocations there only)."""
    device = torch.device(device)
    doc_ids = torch.ones(1, tokens, dtype=torch.long, device=device)
    spread = torch.linspace(1, tokens - block_size - 1, anchors, device=device).long()[None]
    rule = block_rule(doc_ids, spread, torch.ones_like(spread, dtype=torch.bool), block_size)
    if device.type != "cuda":
        return {"held": mask_bytes(rule.build(path, dtype)), "peak": None}
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    built = rule.build(path, dtype)
    torch.cuda.synchronize(device)
    return {"held": mask_bytes(built), "peak": torch.cuda.max_memory_allocated(device) - before}


def describe_4b(device: torch.device | str = "cpu") -> str:
    """The DFlash mask of ``dflash_qwen3_4b`` (3072 tokens, 512 anchors x 16 slots) on each path, in MB."""
    paths = {"dense float32": ("dense", torch.float32), "dense bfloat16": ("dense", torch.bfloat16)}
    paths["flex block mask"] = ("flex", torch.bfloat16)
    parts = []
    for name, (path, dtype) in paths.items():
        memory = mask_memory(3072, 512, 16, path, dtype, device)
        peak = "" if memory["peak"] is None else f" (building it: {memory['peak'] / 1e6:.2f} MB at peak)"
        parts.append(f"{name}: {memory['held'] / 1e6:.2f} MB{peak}")
    return ", ".join(parts)
