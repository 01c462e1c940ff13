"""Drafting sessions: the per-request state a drafter keeps between verification steps.

The engine tells a session what the target committed (``start`` after the prompt, ``commit`` after every
verification, through :func:`commit_verdict`) and a tree builder asks it for drafts. A session says which target
layers it reads (``layer_ids``) and counts its drafter forwards, so that drafting cost compares across drafters.

- :class:`DraftSession` itself: no drafter, plain autoregressive decoding (the baseline runs the same loop).
- :class:`BlockDraftSession`: DFlash; one block forward gives per-depth marginals (chain, DDTree).
- :class:`TreeFlashSession`: DFlash marginals plus TreeFlash's transition tables (docs/algorithms.md §4).
- :class:`Eagle3Session`: EAGLE-3 with EAGLE-2's dynamic tree (docs/algorithms.md §6).
- :class:`SpecBlockSession`: SpecBlock blocks launched from the root and from pending leaves (§5).
- :class:`RecyclingSession`: no drafter; a Token-Recycling adjacency matrix learnt from the target's
  logits at every verified node and prompt position (docs/algorithms.md §8).
- :class:`GraftSession`: an EAGLE-3 or DFlash session plus a shared recycling matrix to graft from (§7).

On CPU, with the shipped tiny models::

    python -c "from trainer.drafters import load_drafter; print(load_drafter('checkpoints/dflash_tiny'))"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from trainer.decoding.tree import Transitions, Tree
from trainer.decoding.verify import Verdict, growing_cache
from trainer.drafters.attention import additive_mask
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.eagle3 import Eagle3DraftModel
from trainer.drafters.specblock import SpecBlockDraftModel, context_mask, launch_mask
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError
from trainer.sampling import top_rows


class DraftSession:
    """Per-request drafter state; the base class drafts nothing. Subclasses that read target features set
    ``layer_ids``; the hooks below do nothing unless a subclass needs them."""

    layer_ids: tuple[int, ...] = ()
    needs_prompt_logits: bool = False

    def __init__(self) -> None:
        self.forwards = 0

    def start(self, prompt: torch.Tensor, features: torch.Tensor | None, logits: torch.Tensor) -> None:
        """The prompt was prefilled. ``prompt`` Shape: (P,); ``features`` (P, n*H) or None; ``logits`` (P or 1, V)."""

    def commit(self, tokens: list[int], features: torch.Tensor | None, tree: Tree, logits: torch.Tensor) -> None:
        """A step committed ``tokens`` (the root, then the accepted drafts; the bonus comes next step as the
        root). ``features`` Shape: (len(tokens), n*H) of exactly those positions; ``logits`` (N + 1, V) of
        every verified node."""


def commit_verdict(
    verdict: Verdict, tokens: list[int], sessions: Iterable[DraftSession],
    features: Mapping[tuple[int, ...], torch.Tensor], tree: Tree, logits: torch.Tensor,
) -> None:  # fmt: skip
    """Commit one row's step, the same for one request (``engine.generate``) and for each row of a batch
    (``batch.BatchEngine._step``): every session in ``sessions`` is told what ``verdict`` committed after
    ``tokens`` (the row's tokens so far, the last being ``tree``'s root), then ``tokens`` grows by it.
    ``features``: per layer set the sessions read, the row's features of the committed nodes (``verdict.path``),
    Shape: (len(path), n*H), gathered by the engine (one row, or every row at once). ``logits`` Shape: (N + 1, V),
    the row's logits of ``tree``."""
    new = verdict.new
    committed = [tokens[-1], *new[:-1]]
    for session in sessions:
        session.commit(committed, features[session.layer_ids] if session.layer_ids else None, tree, logits)
    tokens.extend(new)


class ContextSession(DraftSession):
    """A drafter conditioned on target features of committed positions: it keeps the committed tokens and the
    features it has not consumed yet (``pending``, those of positions ``entered ..``)."""

    def __init__(self, drafter: torch.nn.Module, target: PreTrainedModel, layer_ids: list[int]) -> None:
        super().__init__()
        self.drafter = drafter
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.layer_ids = tuple(layer_ids)
        self.tokens: list[int] = []
        # Shapes: (c_i, n*H) per commit, for the C = Σ c_i committed positions not consumed yet; concatenated when
        # taken, so steps that do not draft (plain decoding chosen by a controller) cost a list append each.
        self._pending: list[torch.Tensor] = []
        self.entered = 0
        # Looked up once: a session lives for one request, and finding a parameter costs a generator per step.
        self.device = next(drafter.parameters()).device

    def start(self, prompt: torch.Tensor, features: torch.Tensor | None, logits: torch.Tensor) -> None:
        self.tokens = prompt.tolist()
        self._pending = [features]

    def commit(self, tokens: list[int], features: torch.Tensor | None, tree: Tree, logits: torch.Tensor) -> None:
        self.tokens += tokens
        self._pending.append(features)

    @property
    def pending(self) -> torch.Tensor | None:
        """Shape: (1, C, n*H) the features of the committed positions not consumed yet (None: all consumed)."""
        if not self._pending:
            return None
        if len(self._pending) > 1:
            self._pending = [torch.cat(self._pending, dim=0)]
        return self._pending[0][None]

    def take_pending(self) -> tuple[int, int, torch.Tensor | None]:
        """Consume the pending features: ``(first position, end position, features or None)``."""
        start, end, pending = self.entered, len(self.tokens), self.pending
        self.entered, self._pending = end, []
        return start, end, pending


class BlockDraftSession(ContextSession):
    """A DFlash drafter: context features are cached in the drafter's KV cache once, then one block forward
    per step from the root (``[root, MASK, ...]``) gives every depth's marginals."""

    def __init__(self, drafter: DFlashDraftModel, target: PreTrainedModel) -> None:
        super().__init__(drafter, target, drafter.target_layer_ids)
        self.max_depth = drafter.block_size - 1
        # The block's keys are appended and cropped every step: a growing cache copies neither the context.
        self.cache = growing_cache(drafter.cache_config)
        # A block drafted ahead in a batch (:func:`draft_blocks`): (root, depth, pre-norm, normed), taken by the
        # next ``_block`` call.
        self.drafted: tuple[int, int, torch.Tensor, torch.Tensor] | None = None

    def _block(self, root: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter hidden states of the block ``[root, MASK x depth]``, pre-norm and normed; ``depth`` is capped at
        the trained block (``block_size - 1``). Shape: (depth + 1, H)"""
        depth = min(depth, self.max_depth)
        if self.drafted is not None:
            (drafted_root, drafted_depth, hidden, normed), self.drafted = self.drafted, None
            if (drafted_root, drafted_depth) != (root, depth):
                raise RuntimeError(
                    f"the batch drafted root {drafted_root} at depth {drafted_depth}; the builder asked for root "
                    f"{root} at depth {depth}"
                )
            return hidden, normed
        device = self.device
        block = torch.full((1, depth + 1), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = root
        start, end, pending = self.take_pending()
        positions = torch.arange(start, end + depth + 1, device=device)[None]
        dtype = self.drafter.fc.weight.dtype
        if pending is None:
            pending = torch.zeros(1, 0, self.drafter.fc.in_features, device=device)
        hidden = self.drafter(
            noise_embedding=self.embed(block).to(dtype),
            target_hidden=pending.to(dtype),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            return_prenorm=True,
        )
        # The context keys stay cached; the block's keys are dropped (the next block starts elsewhere).
        self.cache.crop(-(depth + 1))
        self.forwards += 1
        return hidden[0], self.drafter.norm(hidden[0])

    def depth_logits(self, root: int, depth: int) -> torch.Tensor:
        """Marginal logits of depths ``1..d``, ``d = min(depth, block_size - 1)``. Shape: (d, V)"""
        _, normed = self._block(root, depth)
        return self.head(normed[1:]).float()


def draft_blocks(sessions: list[BlockDraftSession], roots: list[int], depths: list[int]) -> None:
    """Draft the block ``[roots[b], MASK x depths[b]]`` of every session (all of one drafter) in one drafter
    forward; each session's next ``_block(root, depth)`` returns its row, as its own forward would have.

    Rows are ragged: each has its cached context keys (``P_b``), pending context features (``C_b``) and block
    (``Q_b = depth_b + 1``). They are padded to ``(P, C, Q)``, left-aligned in each part, and a mask lets a row's
    queries see only its own cached keys, pending context and block (the single-row forward's view: no mask
    within a row). Each session's cache then receives its own new context keys; the block keys are dropped."""
    drafter = sessions[0].drafter
    if any(s.drafter is not drafter for s in sessions):
        raise ValueError("draft_blocks drafts sessions of one drafter per forward")
    device, dtype = sessions[0].device, drafter.fc.weight.dtype
    depths = [min(d, s.max_depth) for s, d in zip(sessions, depths, strict=True)]
    taken = [s.take_pending() for s in sessions]
    rows = len(sessions)
    cached = [s.cache.get_seq_length() for s in sessions]
    contexts = [end - start for start, end, _ in taken]
    p, c, q = max(cached), max(contexts), max(depths) + 1
    # Shape: (B, C, n*H) pending features, (B, Q) block tokens, (B, C + Q) positions.
    features = torch.zeros(rows, c, drafter.fc.in_features, dtype=dtype, device=device)
    block = torch.full((rows, q), drafter.mask_token_id, dtype=torch.long, device=device)
    positions = torch.zeros(rows, c + q, dtype=torch.long, device=device)
    # Shape: (B, P + C + Q) keys each row's queries may see.
    visible = torch.zeros(rows, p + c + q, dtype=torch.bool, device=device)
    for b, ((start, end, pending), root, depth) in enumerate(zip(taken, roots, depths, strict=True)):
        if pending is not None:
            features[b, : end - start] = pending[0].to(dtype)
        block[b, 0] = root
        positions[b, : end - start] = torch.arange(start, end, device=device)
        positions[b, c:] = torch.arange(end, end + q, device=device)
        visible[b, : cached[b]] = True
        visible[b, p : p + end - start] = True
        visible[b, p + c : p + c + depth + 1] = True
    batch_cache = _padded_cache(sessions, p, drafter.cache_config)
    hidden = drafter(
        noise_embedding=sessions[0].embed(block).to(dtype),
        target_hidden=features,
        position_ids=positions,
        attention_mask=visible[:, None, None, :].expand(-1, 1, q, -1),
        past_key_values=batch_cache,
        use_cache=True,
        return_prenorm=True,
    )
    for b, (session, root, depth) in enumerate(zip(sessions, roots, depths, strict=True)):
        if contexts[b]:
            for layer, batch_layer in enumerate(batch_cache.layers):
                new = slice(p, p + contexts[b])
                session.cache.update(batch_layer.keys[b : b + 1, :, new], batch_layer.values[b : b + 1, :, new], layer)
        session.forwards += 1
        row = hidden[b, : depth + 1]
        session.drafted = (root, depth, row, drafter.norm(row))


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """One row's cached keys or values zero-padded to ``length`` positions. Shape: (1, kv_heads, length, D)"""
    return F.pad(tensor, (0, 0, 0, length - tensor.shape[-2]))


class TreeFlashSession(BlockDraftSession):
    """TreeFlash: the DFlash block forward, then the AR-approximator on every (slot, candidate previous
    token) pair in one batch — no extra drafter forward."""

    def __init__(self, drafter: TreeFlashDraftModel, target: PreTrainedModel) -> None:
        super().__init__(drafter.model, target)
        self.treeflash = drafter
        # Stage one's width the checkpoint was trained and shipped for (reference: 16).
        self.candidate_tokens = int(drafter.config.treeflash_config["candidate_tokens"])

    def transitions(self, root: int, depth: int, top_m: int, top_k: int, temperature: float = 1.0) -> Transitions:
        """Stage one (top-M candidates per slot from the marginals) and stage two (top-K corrected
        continuations per slot and candidate previous token)."""
        hidden, normed = self._block(root, depth)
        # Shape: (depth + 1, V); row 0 is the root's slot, which drafts nothing.
        marginal = self.head(normed).float()
        m = min(top_m, marginal.shape[-1])
        # Shape: (depth + 1, M): every slot's top-M candidates, computed once for both stages.
        top_m_ids = marginal.topk(m, dim=-1).indices
        # Shape: (depth, M): candidates of slots 0..depth-1 as previous tokens of slots 1..depth (slot 0: the root).
        prev = top_m_ids[:-1].clone()
        prev[0] = root
        dtype = hidden.dtype
        # Shape: (depth, M, H)
        prev_embedding = self.embed(prev).to(dtype)
        corrected = self.treeflash.correct(
            hidden[1:, None].expand(-1, m, -1), normed[1:, None].expand(-1, m, -1), prev_embedding
        )
        logprobs = F.log_softmax(self.head(corrected).float() / temperature, dim=-1)
        top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        # Candidates of slots 1..depth, in the rows of the slots they belong to.
        return Transitions.from_candidates(top_m_ids[1:], top.indices, top.values)

    def chain(self, root: int, depth: int) -> torch.Tensor:
        """TreeFlash's greedy chain of depths ``1..d``, ``d = min(depth, block_size - 1)``: one block forward, then
        slot ``j``'s token is the argmax of its state corrected by the token chosen at slot ``j - 1`` (slot 1: by
        ``root``), one approximator and head per slot. Shape: (d,)"""
        hidden, normed = self._block(root, depth)
        previous = torch.tensor([root], device=self.device)
        tokens = []
        for slot in range(1, hidden.shape[0]):
            corrected = self.treeflash.correct(hidden[slot], normed[slot], self.embed(previous)[0].to(hidden.dtype))
            previous = self.head(corrected).float().argmax(-1, keepdim=True)
            tokens.append(previous)
        return torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=self.device)


def check_adjacency(adjacency: torch.Tensor, vocab_size: int, version: int | None) -> None:
    """A published adjacency matrix fits a target of ``vocab_size`` tokens: integer ids of Shape (V, k >= 1) in
    [-1, V). Raises UserError saying what does not."""
    if adjacency.dim() != 2 or adjacency.shape[0] != vocab_size or adjacency.shape[1] < 1:
        raise UserError(
            f"adjacency version {version}: expected integer ids of shape ({vocab_size}, k), "
            f"got {adjacency.dtype} {tuple(adjacency.shape)}"
        )
    if adjacency.dtype not in (torch.int32, torch.int64):
        raise UserError(f"adjacency version {version}: expected int32/int64 token ids, got {adjacency.dtype}")
    if adjacency.numel() and (int(adjacency.max()) >= vocab_size or int(adjacency.min()) < -1):
        raise UserError(f"adjacency version {version}: token ids outside [-1, {vocab_size})")


class RecyclingSession(DraftSession):
    """Token Recycling: ``adjacency[x]`` holds the ``width`` most likely successors of token ``x`` as the
    target last predicted them. Kept across requests ("hot start"), so one session serves a whole run."""

    needs_prompt_logits = True

    def __init__(self, vocab_size: int, width: int = 8, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # Shape: (V, width); -1 = no successor seen yet.
        self.adjacency = torch.full((vocab_size, width), -1, dtype=torch.long, device=device)
        # The matrix as last loaded (empty at start): rows that differ from it were learnt here since.
        self._loaded = self.adjacency.clone()
        # The published snapshot the matrix was last loaded from (None: learnt in this process only).
        self.version: int | None = None

    def set_adjacency(self, adjacency: torch.Tensor, version: int | None = None) -> None:
        """Load a published matrix (Shape: (V, k) ids, -1 empty) between steps: the one rule by which a server
        (``trainer serve --watch``) and ``trainer eval --adjacency`` merge a snapshot.

        Rows this process rewrote since the previous load (from the prompts and trees it served) are newer
        evidence than any snapshot, which a daemon built from older logs: they are kept (cut or padded with -1 to
        the snapshot's width), and the snapshot fills every other row. Its width becomes ours (the retrieval
        template follows ``adjacency.shape[1]``). A wrong shape or id is a UserError and changes nothing."""
        check_adjacency(adjacency, self.adjacency.shape[0], version)
        # A copy: learning writes the matrix in place, and the caller's tensor stays the snapshot.
        merged = adjacency.to(device=self.adjacency.device, dtype=torch.long, copy=True)
        local = (self.adjacency != self._loaded).any(1)
        width = min(merged.shape[1], self.adjacency.shape[1])
        merged[local] = -1
        merged[local, :width] = self.adjacency[local, :width]
        self.adjacency = merged
        self._loaded = merged.clone()
        self.version = version

    def learn(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """``adjacency[tokens[i]] = top-width(logits[i])``; a token seen twice keeps its last row, so learning
        several trees' nodes concatenated in order equals learning them one after another."""
        keep = _last_occurrences(tokens)
        if keep is not None:
            tokens, logits = tokens[keep.to(tokens.device)], logits[keep.to(logits.device)]
        top = top_rows(logits, self.adjacency.shape[1])[0]
        self.adjacency[tokens.to(self.adjacency.device)] = top.to(self.adjacency.device)

    def learn_top(self, tokens: torch.Tensor, top_ids: torch.Tensor) -> None:
        """:meth:`learn` from rows whose top ids the caller took (``top_rows`` of the logits, at least as wide as
        the matrix: their first ``width`` columns are the top-``width``). Shape: tokens (N,), top_ids (N, >= width)."""
        keep = _last_occurrences(tokens)
        if keep is not None:
            tokens, top_ids = tokens[keep.to(tokens.device)], top_ids[keep.to(top_ids.device)]
        top = top_ids[:, : self.adjacency.shape[1]]
        self.adjacency[tokens.to(self.adjacency.device)] = top.to(self.adjacency.device)

    def start(self, prompt: torch.Tensor, features: torch.Tensor | None, logits: torch.Tensor) -> None:
        # The prompt's last positions whose logits the prefill computed: all of them, or only the last when the
        # engine's policy was not drafting (trainer/decoding/batch.py).
        self.learn(prompt[prompt.numel() - logits.shape[0] :], logits)

    def commit(self, tokens: list[int], features: torch.Tensor | None, tree: Tree, logits: torch.Tensor) -> None:
        self.learn(tree.tokens.to(logits.device), logits)


def _last_occurrences(tokens: torch.Tensor) -> torch.Tensor | None:
    """The positions of each token's last occurrence in ``tokens`` (Shape: (N,)), in order; None when no token
    repeats. Found in Python: calls carry a prompt or a batch's trees (tens to hundreds of ids), for which a
    vocabulary-sized scatter costs more than the dictionary."""
    last = {token: i for i, token in enumerate(tokens.tolist())}
    if len(last) == tokens.numel():
        return None
    return torch.tensor(sorted(last.values()), dtype=torch.long)


class GraftSession(DraftSession):
    """Graft (docs/algorithms.md §7): a drafter's session for this request plus an adjacency matrix ``M`` shared
    across requests (a :class:`RecyclingSession`, which learns ``M`` from the target's logits at every prompt
    position and verified node, and hot-reloads published versions). The builder drafts with ``draft`` and
    fills the budget that pruning frees from ``memory.adjacency``."""

    needs_prompt_logits = True

    def __init__(self, draft: ContextSession, memory: RecyclingSession) -> None:
        self.draft = draft
        self.memory = memory
        # False when the owner of a shared ``memory`` teaches it every prompt and verified node itself (the batch
        # engine, once per step for all its rows): learning here too would do it twice.
        self.learns_memory = True
        self.layer_ids = draft.layer_ids
        # Per pruning stage (the checkpoints, then "not pruned"), how many steps ended there.
        self.stages: dict[int, int] = {}

    @property
    def forwards(self) -> int:
        return self.draft.forwards

    @property
    def adjacency(self) -> torch.Tensor:
        return self.memory.adjacency

    def set_adjacency(self, adjacency: torch.Tensor, version: int | None = None) -> None:
        """Hot-reload a published ``M`` between steps (:meth:`RecyclingSession.set_adjacency`)."""
        self.memory.set_adjacency(adjacency, version)

    def start(self, prompt: torch.Tensor, features: torch.Tensor | None, logits: torch.Tensor) -> None:
        self.draft.start(prompt, features, logits)
        if self.learns_memory:
            self.memory.start(prompt, features, logits)

    def commit(self, tokens: list[int], features: torch.Tensor | None, tree: Tree, logits: torch.Tensor) -> None:
        self.draft.commit(tokens, features, tree, logits)
        if self.learns_memory:
            self.memory.commit(tokens, features, tree, logits)


class Eagle3Session(ContextSession):
    """EAGLE-3 with EAGLE-2's dynamic tree: context positions are entered into the drafter's KV cache once as
    ``(fuse(f_t), E[x_{t+1}])``; each step enters the pending ones (the last pairs with the root) and then
    expands a beam of frontier nodes depth by depth, one drafter forward per depth."""

    def __init__(self, drafter: Eagle3DraftModel, target: PreTrainedModel) -> None:
        super().__init__(drafter, target, drafter.target_layer_ids)
        self.cache = drafter.make_cache()

    def _forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        self.forwards += 1
        dtype = self.drafter.fc.weight.dtype
        return self.drafter(hidden.to(dtype), self.embed(tokens).to(dtype), positions, mask, self.cache, use_cache=True)

    def enter_context(self, root: int) -> torch.Tensor:
        """Enter the pending context positions; the last one's pre-norm output (it drafts depth 1). Shape: (H,)"""
        device = self.device
        start, end, pending = self.take_pending()
        following = torch.tensor([*self.tokens[start + 1 :], root], device=device)[None]
        positions = torch.arange(start, end, device=device)[None]
        out = self._forward(self.drafter.fuse(pending.to(self.drafter.fc.weight.dtype)), following, positions, None)
        return out[0, -1]

    def expand(self, hidden: torch.Tensor, tokens: torch.Tensor, depth: int, visible: torch.Tensor) -> torch.Tensor:
        """Enter frontier nodes of ``depth`` (Shape: hidden (n, H) of their parents' outputs, tokens (n,)),
        each seeing the context and the tree entries marked in ``visible`` (n, entries so far); their outputs."""
        n = tokens.numel()
        device, dtype = hidden.device, self.drafter.fc.weight.dtype
        allowed = torch.cat(
            [
                torch.ones(n, self.entered, dtype=torch.bool, device=device),
                visible,
                torch.eye(n, dtype=torch.bool, device=device),
            ],
            dim=1,
        )
        mask = additive_mask(allowed, dtype)
        positions = torch.full((1, n), self.entered + depth - 1, device=device)
        return self._forward(hidden[None], tokens[None], positions, mask[None, None])[0]

    def drop_tree(self) -> None:
        """Forget the tree entries, keep the context."""
        extra = self.cache.get_seq_length() - self.entered
        if extra:
            self.cache.crop(-extra)

    def logprobs(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary log-probs. Shape: (..., H) → (..., Vd)"""
        return self.drafter.logits(prenorm).float().log_softmax(-1)


@dataclass
class SpecBlockBlock:
    """One drafted block: every slot's pre-norm state (K, H), log-probs (K, V or Vd: over the draft vocabulary
    when the drafter has its own head, ``drafter.to_target`` maps their columns) and rank classes (K,);
    ``offset``, the cache index of its slot 0; ``visible`` (P,) bool, the cached keys it saw besides its own
    slots; ``position``, the position of its token."""

    hidden: torch.Tensor
    logprobs: torch.Tensor
    classes: list[int]
    offset: int
    visible: torch.Tensor
    position: int

    def seen_from(self, slot: int) -> torch.Tensor:
        """The cached keys a block launched from ``slot`` sees: what this block saw plus its own slots ``0..slot``.
        Shape: (offset + K,) bool."""
        seen = torch.zeros(self.offset + self.hidden.shape[0], dtype=torch.bool, device=self.visible.device)
        seen[: self.visible.numel()] = self.visible
        seen[self.offset : self.offset + slot + 1] = True
        return seen


class SpecBlockSession(ContextSession):
    """SpecBlock: committed positions are entered as context blocks (``K`` slots each, conditioned on their
    target features), then further blocks are launched from pending leaves, several per drafter forward.

    The root block depends on the drafter's alignment (``trainer.drafters.specblock``): under ``next`` the
    newest context position pairs its features with the root, so its context block is the root block, drafted
    by the forward that enters the context; under ``same`` the root block is launched from the last context
    position's slot 0 (which predicted the root), one more forward.

    Drafter keys live in one cache: context slot ``(i, k)`` at ``i*K + k``, then the step's blocks in launch
    order; :meth:`drop_tree` removes the blocks again."""

    def __init__(self, drafter: SpecBlockDraftModel, target: PreTrainedModel) -> None:
        super().__init__(drafter, target, drafter.target_layer_ids)
        self.block_size = drafter.block_size
        self.cache = DynamicCache(config=drafter.config)

    def _heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and rank classes of pre-norm states. Shape: (..., H) → (..., V or Vd), (..., )"""
        normed = self.drafter.norm(hidden)
        logprobs = self.drafter.logits(normed, self.head).float().log_softmax(-1)
        return logprobs, self.drafter.rank_logits(normed, logprobs).argmax(-1)

    def root_block(self, root: int) -> SpecBlockBlock:
        """Enter the pending context positions and draft the root block (depths 1..K after ``root``)."""
        dtype = self.drafter.fuse.weight.dtype
        start, end, pending = self.take_pending()
        shift = self.drafter.token_shift
        # The token of context position i is x_{i+shift}; under `next` the newest one's is the root.
        tokens = torch.tensor([*self.tokens, root][start + shift : end + shift], device=self.device)[None]
        positions = torch.arange(start + shift, end + shift, device=self.device)[None]
        condition = self.drafter.project_features(pending.to(dtype))
        out = self.drafter(condition, self.embed(tokens).to(dtype), positions, past_key_values=self.cache)
        self.forwards += 1
        k = self.block_size
        # Every slot of the earlier positions.
        visible = torch.ones((end - 1) * k, dtype=torch.bool, device=self.device)
        if shift:
            logprobs, classes = self._heads(out[0, -1])
            return SpecBlockBlock(out[0, -1], logprobs, classes.tolist(), (end - 1) * k, visible, end)
        # Launched from slot 0 of the last position, which predicted the root: it sees that slot too.
        visible = torch.cat([visible, torch.ones(1, dtype=torch.bool, device=self.device)])
        return self.launch(out[0, -1, :1], torch.tensor([root], device=self.device), [end], [visible])[0]

    def launch(
        self, conditions: torch.Tensor, tokens: torch.Tensor, positions: list[int], visible: list[torch.Tensor]
    ) -> list[SpecBlockBlock]:
        """Launch N blocks in one forward. Shapes: conditions (N, H) pre-norm states of the launching slots,
        tokens (N,) target ids, ``positions`` of those tokens, ``visible`` (P_n,) the cached keys each block sees
        (a prefix of the cache)."""
        dtype = self.drafter.fuse.weight.dtype
        cached = self.cache.get_seq_length()
        seen = torch.zeros(len(visible), cached, dtype=torch.bool, device=self.device)
        for row, keys in enumerate(visible):
            seen[row, : keys.numel()] = keys
        mask = launch_mask(seen[None], self.block_size)
        position_ids = torch.tensor(positions, device=self.device)[None]
        hidden = self.drafter(
            conditions[None].to(dtype), self.embed(tokens)[None].to(dtype), position_ids, mask, self.cache
        )[0]
        self.forwards += 1
        logprobs, classes = self._heads(hidden)
        k = self.block_size
        return [
            SpecBlockBlock(hidden[n], logprobs[n], classes[n].tolist(), cached + n * k, visible[n], positions[n])
            for n in range(len(visible))
        ]

    def chain(self, root: int, length: int) -> list[int]:
        """SpecBlock's chain: ``length`` target ids drafted after ``root`` (:func:`specblock_chains` of this session
        alone; the ``specblock-chain`` builder's)."""
        return specblock_chains([self], [root], [length])[0]

    def drop_tree(self) -> None:
        """Forget the step's blocks, keep the context."""
        extra = self.cache.get_seq_length() - self.entered * self.block_size
        if extra:
            self.cache.crop(-extra)


def specblock_chains(sessions: list[SpecBlockSession], roots: list[int], lengths: list[int]) -> list[list[int]]:
    """SpecBlock's chain for every session (all of one drafter; the chain vLLM serves): ``lengths[b]`` target ids
    after ``roots[b]``. The root block's greedy slots, then a block launched from the last slot of the block before
    (that slot's state, its greedy token at that token's position, seeing the context and the chain's blocks), one
    drafter forward per round for all sessions at once: ``max(1, ceil(max(lengths) / K))`` forwards (one more under
    ``same`` alignment, whose root block is itself launched). A length of 0 only enters the pending context. Each
    session's context keys stay in its cache; the chain's blocks are dropped.

    Rows are ragged (cached keys ``P_b``, pending positions ``C_b``): they are padded to ``(P, C)``, left-aligned,
    and masked so that each row sees only its own keys, as a forward of its own would."""
    drafter = sessions[0].drafter
    if any(s.drafter is not drafter for s in sessions):
        raise ValueError("specblock_chains drafts sessions of one drafter per forward")
    k, shift = drafter.block_size, drafter.token_shift
    device, dtype = sessions[0].device, drafter.fuse.weight.dtype
    rows = len(sessions)
    taken = [s.take_pending() for s in sessions]
    cached = [s.cache.get_seq_length() for s in sessions]
    counts = [end - start for start, end, _ in taken]
    p, c = max(cached), max(counts)
    # Shapes: (B, C, n*H) pending features, (B, C) tokens, positions and 1 on real (not padding) positions.
    features = torch.zeros(rows, c, drafter.condition_proj.in_features, dtype=dtype, device=device)
    tokens = torch.zeros(rows, c, dtype=torch.long, device=device)
    positions = torch.zeros(rows, c, dtype=torch.long, device=device)
    real = torch.zeros(rows, c, dtype=torch.long, device=device)
    for b, (session, (start, end, pending), root) in enumerate(zip(sessions, taken, roots, strict=True)):
        # The token of context position i is x_{i+shift}; under `next` the newest one's is the root.
        ids = [*session.tokens, root][start + shift : end + shift]
        features[b, : end - start] = pending[0].to(dtype)
        tokens[b, : end - start] = torch.tensor(ids, device=device)
        positions[b, : end - start] = torch.arange(start + shift, end + shift, device=device)
        real[b, : end - start] = 1
    # Shape: (B, 1, C·K, P + C·K): a row's own cached keys, then the context rule over its own positions.
    own_keys = torch.arange(p, device=device) < torch.tensor(cached, device=device)[:, None]
    mask = torch.cat([own_keys[:, None].expand(rows, c * k, p), context_mask(real, k)], dim=-1)[:, None]
    cache = _padded_cache(sessions, p, sessions[0].drafter.config)
    condition = drafter.project_features(features)
    hidden = drafter(condition, sessions[0].embed(tokens).to(dtype), positions, mask, cache)
    for b, session in enumerate(sessions):
        for layer, batch_layer in enumerate(cache.layers):
            new = slice(p, p + counts[b] * k)
            session.cache.update(batch_layer.keys[b : b + 1, :, new], batch_layer.values[b : b + 1, :, new], layer)
        session.forwards += 1
    last = torch.tensor(counts, device=device) - 1
    every = torch.arange(rows, device=device)
    active = [b for b in range(rows) if lengths[b] > 0]
    chains: list[list[int]] = [[] for _ in range(rows)]
    if not active:
        return chains
    # The context keys the chain's launched blocks see: every slot (`next`), or, under `same`, the earlier
    # positions' and the last position's slot 0 (which predicted the root).
    launch = _ChainLaunch(sessions, [end * k if shift else (end - 1) * k + 1 for _, end, _ in taken])
    # Shapes: (A, K, H) the active rows' blocks, (A,) the positions of their tokens. Under `next` the newest context
    # block is the root block; under `same` the root block is launched from its slot 0 with the root.
    newest, position = hidden[every, last][active], positions[every, last][active]
    if shift:
        blocks = newest
    else:
        position = position + 1
        blocks = launch(active, newest[:, 0], torch.tensor(roots, device=device)[active], position)
    head = sessions[0].head
    while True:
        # Shape: (A, K) target ids of the active rows' blocks' greedy slots.
        greedy = drafter.to_target(drafter.logits(drafter.norm(blocks), head).float().log_softmax(-1).argmax(-1))
        for row, b in enumerate(active):
            chains[b] += greedy[row, : lengths[b] - len(chains[b])].tolist()
        going = [row for row, b in enumerate(active) if len(chains[b]) < lengths[b]]
        if not going:
            break
        # A block launched from the last slot starts at that slot's token, K positions after its block's token.
        active, position = [active[row] for row in going], position[going] + k
        blocks = launch(active, blocks[going, -1], greedy[going, -1], position)
    return chains


class _ChainLaunch:
    """The launched blocks of :func:`specblock_chains`, one forward per round over the rows still drafting: a
    cache of every row's context keys (padded to ``P``) and the chain's blocks so far, each row seeing its own."""

    def __init__(self, sessions: list[SpecBlockSession], context: list[int]) -> None:
        self.sessions = sessions
        self.context = context
        self.rounds = 0
        self.rows: list[int] = list(range(len(sessions)))
        self.cache: DynamicCache | None = None

    def __call__(self, rows: list[int], conditions: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
                 ) -> torch.Tensor:  # fmt: skip
        """One block per row of ``rows`` (Shapes: conditions (A, H), tokens (A,), positions (A,)); their pre-norm
        slot states. Shape: (A, K, H)"""
        first = self.sessions[0]
        drafter, k = first.drafter, first.block_size
        if self.cache is None:
            self.cache = _padded_cache(
                self.sessions, max(s.cache.get_seq_length() for s in self.sessions), self.sessions[0].drafter.config
            )
        if rows != self.rows:
            keep = torch.tensor([self.rows.index(b) for b in rows], device=first.device)
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            self.rows = rows
        cached = self.cache.get_seq_length()
        p = cached - self.rounds * k
        # Shape: (A, 1, cached) the row's context keys and every earlier block of its chain.
        seen = torch.zeros(len(rows), 1, cached, dtype=torch.bool, device=first.device)
        for row, b in enumerate(rows):
            seen[row, 0, : self.context[b]] = True
        seen[:, 0, p:] = True
        dtype = drafter.fuse.weight.dtype
        hidden = drafter(conditions[:, None].to(dtype), first.embed(tokens)[:, None].to(dtype), positions[:, None],
                         launch_mask(seen, k), self.cache)  # fmt: skip
        for b in rows:
            self.sessions[b].forwards += 1
        self.rounds += 1
        return hidden[:, 0]


def _padded_cache(sessions: list[ContextSession], length: int, config: PretrainedConfig) -> DynamicCache:
    """The sessions' cached keys and values as one batch, each zero-padded to ``length`` positions (``config``: the
    drafter's cache config)."""
    cache = DynamicCache(config=config)
    if length:
        for layer in range(len(cache.layers)):
            own = [s.cache.layers[layer] for s in sessions]
            like = next(o.keys for o in own if o.is_initialized)
            keys, values = (
                torch.cat([_padded(getattr(o, kind) if o.is_initialized else like[:, :, :0], length) for o in own])
                for kind in ("keys", "values")
            )
            cache.update(keys, values, layer)
    return cache


def uses_drafter(kind: type[DraftSession]) -> bool:
    """Whether sessions of ``kind`` draft with the drafter: all but plain decoding's (the base class) and
    retrieval's. A step drafted by such a session names the drafter and its version in the verifier log."""
    return kind not in (DraftSession, RecyclingSession)
