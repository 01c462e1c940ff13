"""The tree builders: each turns a drafting session's drafts into a tree of at most ``budget`` draft nodes, by
name (``BUILDERS``), and the session a request needs for a builder and a drafter (``make_session``; each drafter
family's session is ``SESSIONS`` and its own builder ``NATIVE_TREES``, keyed by ``trainer.drafters.families``).
On CPU with the shipped tiny models::

    python -c "
    import torch; from transformers import AutoModelForCausalLM as A
    from trainer.drafters import load_drafter
    from trainer.decoding.builders import make_session
    t = A.from_pretrained('checkpoints/target_tiny', dtype=torch.float32).eval()
    print(make_session('ddtree', t, load_drafter('checkpoints/dflash_tiny')))"
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from trainer.decoding.drafting import (
    BlockDraftSession,
    ContextSession,
    DraftSession,
    Eagle3Session,
    GraftSession,
    RecyclingSession,
    SpecBlockBlock,
    SpecBlockSession,
    TreeFlashSession,
    uses_drafter,
)
from trainer.decoding.events import Clock
from trainer.decoding.options import TreeOptions
from trainer.decoding.tree import (
    Tree,
    best_subtree,
    chain,
    ddtree,
    frontier_confidence,
    merge_trie,
    prior_ranks,
    pruned_depth,
    recycling_template,
    retrieval,
    root_only,
    template_by_prior,
    treeflash,
)
from trainer.drafters.families import FAMILIES, family_of
from trainer.errors import UserError

DEFAULT_OPTIONS = TreeOptions()


@dataclass(frozen=True)
class TreeBuilder:
    """A named way to turn a session's drafts into a tree of at most ``budget`` nodes and depth ``max_depth``."""

    name: str
    # The session kind the builder drafts with.
    session: type[DraftSession]
    build: Callable[[DraftSession, int, int, int, Clock, TreeOptions], Tree]
    # For a GraftSession: the builder whose session does the drafting inside it.
    drafts_like: str | None = None

    @property
    def uses_drafter(self) -> bool:
        """Whether its trees come from the drafter (plain decoding and retrieval draft without one)."""
        return uses_drafter(self.session)

    @property
    def uses_adjacency(self) -> bool:
        """Whether its trees come from an adjacency matrix a caller may keep across requests (``make_session``'s
        ``memory``): retrieval's, and Graft's grafts."""
        return self.session in (RecyclingSession, GraftSession)


def _chain(
    session: BlockDraftSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    with clock("draft"):
        logits = session.depth_logits(root, min(max_depth, budget))
    with clock("tree"):
        return chain(root, logits.argmax(-1), budget)


def _ddtree(
    session: BlockDraftSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    with clock("draft"):
        logprobs = session.depth_logits(root, min(max_depth, budget)).log_softmax(-1)
    with clock("tree"):
        return ddtree(logprobs, root, budget)


def _treeflash(
    session: TreeFlashSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    with clock("draft"):
        top_m = options.treeflash_top_m or session.candidate_tokens
        tables = session.transitions(root, min(max_depth, budget), top_m, options.treeflash_top_k)
    with clock("tree"):
        return treeflash(tables, root, budget)


def _treeflash_chain(
    session: TreeFlashSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    """TreeFlash's chain: each depth's argmax given the token drafted before it (what vLLM serves of a TreeFlash
    export, trainer.integrations.vllm.treeflash)."""
    with clock("draft"):
        tokens = session.chain(root, min(max_depth, budget))
    with clock("tree"):
        return chain(root, tokens, budget)


def _recycling(
    session: RecyclingSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    with clock("tree"):
        shape = (budget, session.adjacency.shape[1], options.recycling_decay, options.recycling_max_depth)
        template = [p for p in recycling_template(*shape) if len(p) <= max_depth]
        # Nested: the controller learns every smaller budget's acceptance from this tree's step.
        return retrieval(session.adjacency, root, template, prior_ranks(*shape))


def chain_template(depth: int) -> tuple[tuple[int, ...], ...]:
    """The rank paths of a chain ``depth`` deep: every node the first-ranked successor of its parent."""
    return tuple((0,) * d for d in range(1, depth + 1))


def _recycling_chain(
    session: RecyclingSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    """The chain an engine that verifies chains only drafts from the matrix (vLLM's graft proposer,
    trainer/integrations/vllm/graft.py): from the root, each node's best-ranked successor, ``budget`` deep; it
    ends early at a token without a known successor."""
    with clock("tree"):
        return retrieval(session.adjacency, root, chain_template(min(budget, max_depth)))


def _eagle(session: Eagle3Session, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions) -> Tree:
    """EAGLE-2: expand the ``eagle_top_k`` best frontier nodes by cumulative log-prob, one drafter forward per
    depth, recording every node's top-k children; the tree is the ``budget`` best recorded candidates."""
    found = _eagle_candidates(session, root, max_depth, clock, options, prune=False)
    with clock("tree"):
        return best_subtree(found.tokens, found.parents, found.scores, root, budget)


@dataclass
class _Candidates:
    """EAGLE-2's recorded candidates, one entry per node (a root child's parent is -1; scores are cumulative
    log-probs), and the Graft stage that ended drafting."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    stage: int


def _eagle_candidates(
    session: Eagle3Session, root: int, max_depth: int, clock: Clock, options: TreeOptions, prune: bool
) -> _Candidates:
    """EAGLE-2's recorded candidates and the Graft stage that ended drafting.

    With ``prune``, before each forward that would draft below a checkpoint ``d`` of ``graft_checkpoints``, the
    frontier (the beam at depth ``d + 1``) is judged by ``frontier_confidence``; below the stage's threshold,
    drafting stops there. The stage is the index of the checkpoint that pruned, ``len(graft_checkpoints)`` if
    none did."""
    k = options.eagle_top_k
    checkpoints = options.graft_checkpoints if prune else ()
    stage = len(options.graft_checkpoints)
    with clock("draft"):
        context_out = session.enter_context(root)
        logprobs = session.logprobs(context_out)
    with clock("tree"):
        top = logprobs.topk(min(k, logprobs.numel()))
        tokens = session.drafter.to_target(top.indices).tolist()
        parents = [-1] * len(tokens)
        scores = top.values.tolist()
        frontier = list(range(len(tokens)))
        outputs: dict[int, torch.Tensor] = {}
        slots: dict[int, int] = {}
    for depth in range(1, min(options.eagle_depth, max_depth)):
        with clock("tree"):
            # Frontier nodes sit at `depth`; entering them drafts depth + 1. Checkpoint d judges depth d + 1.
            if depth - 1 in checkpoints:
                at = checkpoints.index(depth - 1)
                parent_scores = [scores[parents[n]] if parents[n] >= 0 else 0.0 for n in frontier]
                confidence = frontier_confidence([scores[n] for n in frontier], parent_scores, options.graft_confidence)
                if confidence < options.graft_thresholds[at]:
                    stage = at
                    break
            visible = torch.zeros(len(frontier), len(slots), dtype=torch.bool, device=context_out.device)
            for row, node in enumerate(frontier):
                ancestor = parents[node]
                while ancestor >= 0:
                    visible[row, slots[ancestor]] = True
                    ancestor = parents[ancestor]
            hidden = torch.stack([outputs[parents[n]] if parents[n] >= 0 else context_out for n in frontier])
            node_tokens = torch.tensor([tokens[n] for n in frontier], device=context_out.device)
        with clock("draft"):
            out = session.expand(hidden, node_tokens, depth, visible)
            logprobs = session.logprobs(out)
        with clock("tree"):
            for row, node in enumerate(frontier):
                slots[node] = len(slots)
                outputs[node] = out[row]
            top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
            # Shape: (n, k) cumulative scores of every child of every frontier node.
            child_scores = top.values + torch.tensor([scores[n] for n in frontier], device=top.values.device)[:, None]
            first = len(tokens)
            tokens += session.drafter.to_target(top.indices).flatten().tolist()
            parents += [n for n in frontier for _ in range(top.indices.shape[1])]
            scores += child_scores.flatten().tolist()
            best = child_scores.flatten().topk(min(k, child_scores.numel())).indices
            frontier = sorted(first + int(i) for i in best)
    with clock("draft"):
        session.drop_tree()
    return _Candidates(tokens, parents, scores, stage)


def _draft_budget(budget: int, stage: int, options: TreeOptions) -> int:
    """Drafted nodes kept at a Graft stage: the stage's share, or the whole budget without retrieval."""
    return round(budget * options.graft_draft_share[stage]) if options.graft_retrieval else budget


def _graft_retrieval(
    session: GraftSession, draft: Tree, stage: int, budget: int, max_depth: int, options: TreeOptions
) -> Tree:
    """Fill the budget the drafted tree left with the retrieval template from ``M``, merged as a trie.

    The template is Token Recycling's prior order, long enough that the retrieval paths that collapse into
    drafted ones (at most ``draft.size``) and those ``M`` cannot fill are made up by further paths; the tree
    falls short of ``budget`` only when the rows of ``M`` it reaches hold too few distinct successors."""
    session.stages[stage] = session.stages.get(stage, 0) + 1
    if not options.graft_retrieval:
        return draft
    adjacency = session.adjacency
    paths = template_by_prior(
        2 * budget + draft.size, adjacency.shape[1], options.recycling_decay, options.recycling_max_depth
    )
    template = [p for p in paths if len(p) <= max_depth]
    return merge_trie(draft, retrieval(adjacency, draft.tokens[0].item(), template), budget)


def _graft(session: GraftSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions) -> Tree:
    """Graft over EAGLE-3: EAGLE-2's tree pruned in depth at the checkpoints, the stage's share of the budget
    kept for its best candidates, the rest grafted from ``M`` (docs/algorithms.md §7)."""
    found = _eagle_candidates(session.draft, root, max_depth, clock, options, prune=True)
    with clock("tree"):
        share = _draft_budget(budget, found.stage, options)
        draft = best_subtree(found.tokens, found.parents, found.scores, root, share)
        return _graft_retrieval(session, draft, found.stage, budget, max_depth, options)


def _graft_dflash(
    session: GraftSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    """Graft over DFlash: one block forward's marginals, DDTree limited to the depth the checkpoints allow
    (frontiers of ``eagle_top_k`` tokens, so both variants judge frontiers of one width), the rest from ``M``."""
    with clock("draft"):
        logprobs = session.draft.depth_logits(root, min(max_depth, budget)).log_softmax(-1)
    with clock("tree"):
        stage, depth = pruned_depth(
            logprobs, options.graft_checkpoints, options.graft_thresholds, options.eagle_top_k, options.graft_confidence
        )
        draft = ddtree(logprobs[:depth], root, _draft_budget(budget, stage, options))
        return _graft_retrieval(session, draft, stage, budget, max_depth, options)


@dataclass
class _Launch:
    """Where a pending leaf's block starts: the tree node it continues, the drafted slot's state, the keys that
    slot saw, the position of the node's token."""

    node: int
    condition: torch.Tensor
    visible: torch.Tensor
    position: int


class _SpecBlockTree:
    """The candidates a SpecBlock step grows (EAGLE-2's recording: token, parent, cumulative log-prob) and the
    leaves waiting for a block. A token drafted twice under one parent (a launched block re-drafting the next
    token of the block it came from) is one candidate: the tree keeps the first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depths: list[int] = []
        self.children: dict[tuple[int, int], int] = {}
        self.pending: list[_Launch] = []

    def score(self, node: int) -> float:
        return self.scores[node] if node >= 0 else 0.0

    def depth(self, node: int) -> int:
        return self.depths[node] if node >= 0 else 0

    def add(self, parent: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Children of ``parent`` with these tokens (new candidates, or the ones drafted before)."""
        nodes = []
        for token, lp in zip(tokens, logprobs, strict=True):
            node = self.children.get((parent, token))
            if node is None:
                node = self.children[(parent, token)] = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(parent)
                self.scores.append(self.score(parent) + lp)
                self.depths.append(self.depth(parent) + 1)
            nodes.append(node)
        return nodes

    def grow(
        self,
        block: SpecBlockBlock,
        node: int,
        to_target: Callable[[torch.Tensor], torch.Tensor],
        root: bool,
        max_depth: int,
        options: TreeOptions,
    ) -> None:
        """Walk ``block``'s slots from ``node``, adding each slot's children by its rank class (``root``: the root
        block, whose slot 0 takes ``specblock_root_width``), and queue the leaves that launch blocks."""
        k_slots = block.hidden.shape[0]
        stopped = False
        for slot in range(k_slots):
            if self.depth(node) >= max_depth:
                return
            width = options.specblock_branch[block.classes[slot]]
            if root and slot == 0 and options.specblock_root_width is not None:
                width = options.specblock_root_width
            if width == 0:
                if options.specblock_stop == "chain":
                    return
                stopped = True
            width = 1 if stopped else width
            top = block.logprobs[slot].topk(min(width, block.logprobs.shape[-1]))
            children = self.add(node, to_target(top.indices).tolist(), top.values.tolist())
            seen = block.seen_from(slot)
            position = block.position + 1 + slot
            if width > 1:
                launching = children if options.specblock_launch_greedy else children[1:]
                self.pending += [_Launch(c, block.hidden[slot], seen, position) for c in launching]
            node = children[0]
            if slot == k_slots - 1 and not stopped and not (width > 1 and options.specblock_launch_greedy):
                self.pending.append(_Launch(node, block.hidden[slot], seen, position))


def _specblock(
    session: SpecBlockSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    """SpecBlock growth (docs/specblock.md): the root block, then ``specblock_rounds - 1`` rounds of blocks
    launched from pending leaves, one drafter forward per round; each block adds its greedy tokens and, per
    slot, alternatives by rank class; the tree is the ``budget`` best candidates by cumulative log-prob. A
    round launches the best pending leaves that could still enter the pruned tree (a leaf's descendants never
    score above it), at most ``specblock_blocks_per_round`` and no more than the budget left holds blocks of K."""
    k_slots = session.block_size
    to_target = session.drafter.to_target
    with clock("draft"):
        block = session.root_block(root)
    with clock("tree"):
        tree = _SpecBlockTree()
        tree.grow(block, -1, to_target, True, max_depth, options)
    for _ in range(options.specblock_rounds - 1):
        with clock("tree"):
            scores = tree.scores
            cutoff = sorted(scores, reverse=True)[budget - 1] if len(scores) >= budget else -math.inf
            ready = [p for p in tree.pending if tree.score(p.node) > cutoff and tree.depth(p.node) < max_depth]
            ready.sort(key=lambda p: tree.score(p.node), reverse=True)
            per_round = min(options.specblock_blocks_per_round, max(1, (budget - len(scores)) // k_slots))
            batch, tree.pending = ready[:per_round], ready[per_round:]
            if not batch:
                break
            tokens = torch.tensor([tree.tokens[p.node] for p in batch], device=session.device)
        with clock("draft"):
            blocks = session.launch(
                torch.stack([p.condition for p in batch]),
                tokens,
                [p.position for p in batch],
                [p.visible for p in batch],
            )
        with clock("tree"):
            for launch, block in zip(batch, blocks, strict=True):
                tree.grow(block, launch.node, to_target, False, max_depth, options)
    with clock("draft"):
        session.drop_tree()
    with clock("tree"):
        return best_subtree(tree.tokens, tree.parents, tree.scores, root, budget)


def _specblock_chain(
    session: SpecBlockSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions
) -> Tree:
    """SpecBlock's chain, as vLLM drafts it (:meth:`SpecBlockSession.chain`): greedy slots of the root block, then of
    blocks launched from each block's last slot, ``min(max_depth, budget)`` deep."""
    with clock("draft"):
        tokens = session.chain(root, min(max_depth, budget))
    with clock("tree"):
        return chain(root, torch.tensor(tokens, dtype=torch.long), budget)


def _none(session: DraftSession, root: int, budget: int, max_depth: int, clock: Clock, options: TreeOptions) -> Tree:
    return root_only(root)


BUILDERS: dict[str, TreeBuilder] = {
    b.name: b
    for b in (
        TreeBuilder("chain", BlockDraftSession, _chain),
        TreeBuilder("ddtree", BlockDraftSession, _ddtree),
        TreeBuilder("treeflash", TreeFlashSession, _treeflash),
        TreeBuilder("treeflash-chain", TreeFlashSession, _treeflash_chain),
        TreeBuilder("recycling", RecyclingSession, _recycling),
        TreeBuilder("recycling-chain", RecyclingSession, _recycling_chain),
        TreeBuilder("eagle", Eagle3Session, _eagle),
        TreeBuilder("specblock", SpecBlockSession, _specblock),
        TreeBuilder("specblock-chain", SpecBlockSession, _specblock_chain),
        TreeBuilder("graft", GraftSession, _graft, drafts_like="eagle"),
        TreeBuilder("graft-dflash", GraftSession, _graft_dflash, drafts_like="ddtree"),
        TreeBuilder("none", DraftSession, _none),
    )
}


# Each drafter family's session (trainer.drafters.families).
SESSIONS: dict[str, type[ContextSession]] = {
    "dflash": BlockDraftSession,
    "treeflash": TreeFlashSession,
    "eagle3": Eagle3Session,
    "specblock": SpecBlockSession,
}

# Each drafter family's own tree builder (its paper's): what serving drafts with unless told otherwise.
NATIVE_TREES: dict[str, str] = {
    "dflash": "ddtree",
    "treeflash": "treeflash",
    "eagle3": "eagle",
    "specblock": "specblock",
}


def native_tree(drafter: torch.nn.Module) -> str:
    """The tree builder of ``drafter``'s family (``NATIVE_TREES``)."""
    return NATIVE_TREES[family_of(drafter).name]


def session_class(tree: str, drafter: torch.nn.Module | None) -> type[DraftSession]:
    """The session class builder ``tree`` drafts with for ``drafter`` (None: no drafter); a clear UserError when the
    drafter cannot serve the builder. Checks without making a session, so an engine refuses a builder once, when it
    is configured, rather than at every request."""
    if tree not in BUILDERS:
        raise UserError(f"unknown tree builder {tree!r}; choose from {sorted(BUILDERS)}")
    builder = BUILDERS[tree]
    need = builder.session
    if need is GraftSession:
        try:
            session_class(builder.drafts_like, drafter)
        except UserError as e:
            raise UserError(f"tree builder {tree!r} drafts as {builder.drafts_like!r} does: {e}") from None
        return GraftSession
    if need in (RecyclingSession, DraftSession):
        return need
    if drafter is None:
        raise UserError(f"tree builder {tree!r} needs a drafter (--drafter)")
    # A builder serves the families whose session is (a subclass of) the one it needs: TreeFlash's also serves
    # DFlash's chain and DDTree builders.
    session = SESSIONS[family_of(drafter).name]
    if not issubclass(session, need):
        wants = [
            f.cls.__name__.removesuffix("DraftModel") for f in FAMILIES.values() if issubclass(SESSIONS[f.name], need)
        ]
        raise UserError(f"tree builder {tree!r} needs a {' or '.join(wants)} drafter; got a {type(drafter).__name__}")
    return session


def make_session(
    tree: str,
    target: PreTrainedModel,
    drafter: torch.nn.Module | None,
    options: TreeOptions = DEFAULT_OPTIONS,
    memory: RecyclingSession | None = None,
) -> DraftSession:
    """The session one request drafts with under builder ``tree`` (fresh, but for the caller's ``memory``); a clear
    error when the drafter cannot serve it (``session_class``).

    ``memory``: the adjacency matrix kept across requests by the caller (``TreeBuilder.uses_adjacency``): the
    recycling session itself, or what a Graft session grafts from; a fresh, empty one if None."""
    kind = session_class(tree, drafter)
    if kind in (RecyclingSession, GraftSession) and memory is None:
        memory = RecyclingSession(target.config.vocab_size, options.recycling_width, device=target.device)
    if kind is RecyclingSession:
        return memory
    if kind is GraftSession:
        return GraftSession(make_session(BUILDERS[tree].drafts_like, target, drafter, options), memory)
    if kind is DraftSession:
        return DraftSession()
    return kind(drafter, target)
