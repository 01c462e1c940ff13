"""Draft trees and the pure tensor functions that build them (docs/algorithms.md §2, §4, §7, §8).

A tree is a root (the last committed token, whose target logits are not computed yet) plus ``N`` draft
nodes; the node budget always counts draft nodes only, root excluded. Nodes are stored in topological
order: node 0 is the root and ``parents[i] < i`` for every other node, so a tree can be verified in one
target forward with an ancestor mask. Builders never emit two siblings with the same token (a duplicate
could never be the accepted child, it would only waste budget).

Every builder here is a function of tensors and a budget, testable without a model::

    python -c "import torch; from trainer.decoding.tree import ddtree; \\
        print(ddtree(torch.randn(4, 10).log_softmax(-1), root=0, budget=6))"
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class Tree:
    """Root plus draft nodes in topological order."""

    # Shape: (N + 1,) int64; tokens[0] is the root
    tokens: torch.Tensor
    # Shape: (N + 1,) int64; parents[0] == -1, 0 <= parents[i] < i
    parents: torch.Tensor

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int]) -> Tree:
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    @property
    def size(self) -> int:
        """Draft nodes, root excluded (the budget unit)."""
        return self.tokens.numel() - 1

    @functools.cached_property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it (a single path). Computed once: trees are immutable."""
        return bool((self.parents[1:] == torch.arange(self.parents.numel() - 1)).all())

    def depths(self) -> torch.Tensor:
        """Depth of every node (root 0); not to be modified. Shape: (N + 1,)"""
        return self._depths

    @functools.cached_property
    def _depths(self) -> torch.Tensor:
        # Computed once (trees are immutable): a step reads its trees' depths for positions, for the controller's
        # acceptance, and once more per smaller budget of a nested tree.
        if self.is_chain:
            return torch.arange(self.parents.numel())
        parents = self.parents.tolist()
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        return torch.tensor(depth, dtype=torch.long)

    def ancestor_mask(self) -> torch.Tensor:
        """``mask[i, j]``: node ``j`` is node ``i`` or one of its ancestors. Shape: (N + 1, N + 1) bool"""
        n = self.tokens.numel()
        if self.is_chain:
            return torch.ones(n, n, dtype=torch.bool).tril()
        mask = torch.eye(n, dtype=torch.bool)
        parents = self.parents.tolist()
        for i in range(1, n):
            mask[i] |= mask[parents[i]]
        return mask

    def children(self) -> list[dict[int, int]]:
        """Per node, ``{token: child index}``."""
        out: list[dict[int, int]] = [{} for _ in range(self.tokens.numel())]
        for i, (p, t) in enumerate(zip(self.parents.tolist(), self.tokens.tolist(), strict=True)):
            if i:
                out[p][t] = i
        return out

    def validate(self) -> None:
        """Raise ``ValueError`` when the invariants above do not hold."""
        parents = self.parents.tolist()
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1 or not parents or parents[0] != -1:
            raise ValueError("a tree needs equal 1-D tokens and parents with parents[0] == -1")
        seen: set[tuple[int, int]] = set()
        for i in range(1, len(parents)):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i} has parent {parents[i]}: parents must precede their children")
            key = (parents[i], int(self.tokens[i]))
            if key in seen:
                raise ValueError(f"node {i} duplicates a sibling's token {key[1]}")
            seen.add(key)


@dataclass(frozen=True)
class NestedTree(Tree):
    """A tree whose nodes up to any smaller budget form the tree its builder gives at that budget (a retrieval
    template is a best-first order, and its every prefix is the template of that size). Verification walks the
    tree drawing one target token per position and stops at the first token no child holds, so the walk over the
    smaller tree is this tree's accepted path cut at its first node that the smaller tree lacks: one step tells
    what every smaller budget would have accepted."""

    # Shape: (N + 1,) int64: the smallest budget whose tree holds the node (0 for the root); it grows along every
    # path (a child comes after its parent in the template's order).
    budgets: torch.Tensor

    def within(self, path: list[int], budget: int) -> tuple[int, int]:
        """For the tree of ``budget``: the length of ``path`` (accepted node indices from the root) it would have
        accepted, and its depth."""
        budgets = self.budgets.tolist()
        kept = sum(1 for node in path if budgets[node] <= budget)
        inside = self.budgets <= budget
        return kept, int(self.depths()[inside].max())


def root_only(root: int) -> Tree:
    """The empty tree: verifying it is one step of plain autoregressive decoding."""
    return Tree.from_lists([root], [-1])


def chain(root: int, tokens: torch.Tensor, budget: int) -> Tree:
    """A single path of the first ``budget`` drafted tokens (DFlash's greedy block). ``tokens`` Shape: (D,)"""
    draft = tokens[:budget].to("cpu", torch.long)
    return Tree(torch.cat([torch.tensor([root]), draft]), torch.arange(-1, draft.numel()))


def _best_first(
    root: int,
    budget: int,
    first: tuple[float, int, int],
    sibling,
    child,
) -> Tree:
    """Best-first growth shared by DDTree and TreeFlash.

    A heap entry is ``(-score, order, source, rank, parent, token)``; ``sibling(source, rank)`` gives the next
    candidate of the same source row as ``(delta_score, source, rank + 1, token)`` or ``None``, and
    ``child(source, rank, token)`` the first candidate under a popped node as ``(log-prob, source, 0, token)``
    or ``None``. Scores are sums of log-probs, so they never grow along siblings or children and the popped
    nodes always form a tree. ``order`` breaks ties by insertion order, which keeps the result deterministic.
    """
    tokens, parents = [root], [-1]
    score0, source0, token0 = first
    heap = [(-score0, 0, source0, 0, 0, token0)]
    pushed = 1
    while heap and len(tokens) <= budget:
        neg, _, source, rank, parent, token = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        nxt = sibling(source, rank)
        if nxt is not None:
            delta, nsource, nrank, ntoken = nxt
            heapq.heappush(heap, (neg + delta, pushed, nsource, nrank, parent, ntoken))
            pushed += 1
        below = child(source, rank, token)
        if below is not None:
            lp, csource, crank, ctoken = below
            heapq.heappush(heap, (neg - lp, pushed, csource, crank, node, ctoken))
            pushed += 1
    return Tree.from_lists(tokens, parents)


def ddtree(logprobs: torch.Tensor, root: int, budget: int) -> Tree:
    """DDTree: the best tree of ``budget`` nodes from per-depth marginals (docs/algorithms.md §2).

    ``logprobs`` Shape: (D, V), row ``d`` the log-probs of depth ``d + 1``. A node at depth ``d`` with rank ``r``
    among depth ``d``'s top tokens has siblings of rank ``r + 1`` and a first child of rank 0 at depth ``d + 1``.
    """
    depth_count = logprobs.shape[0]
    if budget <= 0 or depth_count == 0:
        return root_only(root)
    k = min(budget, logprobs.shape[1])
    top = logprobs.float().topk(k, dim=-1)
    # Python lists: the heap loop touches single scalars, which tensors make 10x slower.
    values, ids = top.values.tolist(), top.indices.tolist()

    def sibling(depth: int, rank: int):
        if rank + 1 >= k:
            return None
        return values[depth][rank] - values[depth][rank + 1], depth, rank + 1, ids[depth][rank + 1]

    def child(depth: int, rank: int, token: int):
        if depth + 1 >= depth_count:
            return None
        return values[depth + 1][0], depth + 1, 0, ids[depth + 1][0]

    return _best_first(root, budget, (values[0][0], 0, ids[0][0]), sibling, child)


@dataclass(frozen=True)
class Transitions:
    """TreeFlash's stage-two tables (docs/algorithms.md §4) for slots ``1..D``; row ``d`` is slot ``d + 1``.

    ``tokens[d, m]`` / ``logprobs[d, m]`` are the top-K corrected tokens and log-probs of slot ``d + 1`` given
    that the previous slot carries candidate ``m`` (slot 1: the root, row ``m = 0`` only). ``next_index[d, m, j]``
    is the row of ``tokens[d, m, j]`` among slot ``d + 1``'s own candidates, i.e. the row its children come from,
    or -1 when the token is not a candidate there (such a node cannot be expanded).
    """

    # Shape: (D, M, K) int64
    tokens: torch.Tensor
    # Shape: (D, M, K) float
    logprobs: torch.Tensor
    # Shape: (D, M, K) int64
    next_index: torch.Tensor

    @classmethod
    def from_candidates(cls, candidates: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> Transitions:
        """Derive ``next_index``. ``candidates`` Shape: (D, M), row ``d`` = slot ``d + 1``'s top-M marginal tokens,
        the previous tokens that slot ``d + 2``'s rows were computed for."""
        # Shape: (D - 1, M, K, M): is transition token (d, m, j) candidate m' of its own slot?
        match = tokens[:-1, :, :, None] == candidates[:-1, None, None, :]
        found = match.any(-1)
        index = torch.where(found, match.float().argmax(-1), torch.full_like(found, -1, dtype=torch.long))
        last = torch.full_like(tokens[:1], -1)
        return cls(tokens, logprobs, torch.cat([index, last], dim=0))


def treeflash(transitions: Transitions, root: int, budget: int) -> Tree:
    """TreeFlash's stage-two tree: DDTree's best-first heap where a node's children come from its own
    transition row (docs/algorithms.md §4)."""
    if budget <= 0 or transitions.tokens.shape[0] == 0:
        return root_only(root)
    depth_count, _, k = transitions.tokens.shape
    tokens, logprobs = transitions.tokens.tolist(), transitions.logprobs.float().tolist()
    nexts = transitions.next_index.tolist()
    # A source is (depth row, candidate row); ranks index the K transition tokens of that row.

    def sibling(source: tuple[int, int], rank: int):
        d, m = source
        if rank + 1 >= k:
            return None
        return logprobs[d][m][rank] - logprobs[d][m][rank + 1], source, rank + 1, tokens[d][m][rank + 1]

    def child(source: tuple[int, int], rank: int, token: int):
        d, m = source
        row = nexts[d][m][rank]
        if row < 0 or d + 1 >= depth_count:
            return None
        return logprobs[d + 1][row][0], (d + 1, row), 0, tokens[d + 1][row][0]

    return _best_first(root, budget, (logprobs[0][0][0], (0, 0), tokens[0][0][0]), sibling, child)


@functools.cache
def recycling_template(
    budget: int, width: int = 8, decay: float = 0.5, max_depth: int = 6
) -> tuple[tuple[int, ...], ...]:
    """A static Token-Recycling style template: ``budget`` rank paths, parents before children.

    Paths are chosen best-first under a fixed prior where the ``r``-th most likely successor is right with
    probability ``(1 - decay) * decay**r`` at any depth, so the template is wide near the root and thin deep
    down, like Token Recycling's hand-made 80-node tree (8/21/25/15/8/3 nodes per depth).
    """
    return tuple(sorted(template_by_prior(budget, width, decay, max_depth), key=lambda p: (len(p), p)))


@functools.cache
def template_by_prior(budget: int, width: int, decay: float, max_depth: int) -> tuple[tuple[int, ...], ...]:
    """:func:`recycling_template`'s paths in the order the prior ranks them, best first. Every prefix of this
    order is the template of that size, and parents come before their children (a child's prior is its
    parent's times a factor below 1), so a consumer may stop anywhere and still hold a tree."""
    log_p = [math.log((1 - decay) * decay**r) for r in range(width)]
    paths: list[tuple[int, ...]] = []
    heap = [(-log_p[0], (0,))]
    while heap and len(paths) < budget:
        neg, path = heapq.heappop(heap)
        paths.append(path)
        # Each path is pushed once: by its left sibling (rank > 0) or by its parent (rank 0).
        if path[-1] + 1 < width:
            heapq.heappush(heap, (neg + log_p[path[-1]] - log_p[path[-1] + 1], (*path[:-1], path[-1] + 1)))
        if len(path) < max_depth:
            heapq.heappush(heap, (neg - log_p[0], (*path, 0)))
    return tuple(paths)


@functools.cache
def prior_ranks(budget: int, width: int, decay: float, max_depth: int) -> Mapping[tuple[int, ...], int]:
    """Each path of :func:`template_by_prior` with its 1-based place in that order: the smallest budget whose
    template holds it."""
    return MappingProxyType({path: i + 1 for i, path in enumerate(template_by_prior(budget, width, decay, max_depth))})


def retrieval(
    adjacency: torch.Tensor,
    root: int,
    template: Sequence[tuple[int, ...]],
    ranks: Mapping[tuple[int, ...], int] | None = None,
) -> Tree:
    """Fill a rank-path template from an adjacency matrix: ``token(node) = adjacency[token(parent), rank]``.

    ``adjacency`` Shape: (V, W) successor ids, best first. Paths whose token repeats a sibling's (an adjacency
    row with repeated ids) are dropped together with their subtree; -1 entries (no successor known) likewise.
    With ``ranks`` (each path's 1-based place in a best-first order whose every prefix is a template, as
    :func:`prior_ranks`), the tree is a :class:`NestedTree`: a sibling is dropped for repeating a lower rank's
    token, which every prefix holds too, so the nodes of rank at most ``b`` are exactly the tree of that prefix.
    """
    rows: dict[int, list[int]] = {}
    tokens, parents = [root], [-1]
    index: dict[tuple[int, ...], int] = {(): 0}
    taken: set[tuple[int, int]] = set()
    for path in template:
        parent = index.get(path[:-1])
        if parent is None:
            continue
        source = tokens[parent]
        if source not in rows:
            # Only the rows the template reaches, not the whole (V, W) matrix, cross to Python.
            rows[source] = adjacency[source].tolist()
        token = rows[source][path[-1]]
        if token < 0 or (parent, token) in taken:
            continue
        taken.add((parent, token))
        index[path] = len(tokens)
        tokens.append(token)
        parents.append(parent)
    if ranks is None:
        return Tree.from_lists(tokens, parents)
    budgets = [0] * len(tokens)
    for path, node in index.items():
        if path:
            budgets[node] = ranks[path]
    as_long = functools.partial(torch.tensor, dtype=torch.long)
    return NestedTree(as_long(tokens), as_long(parents), as_long(budgets))


def best_subtree(tokens: list[int], parents: list[int], scores: list[float], root: int, budget: int) -> Tree:
    """The ``budget`` best-scoring recorded candidates as a tree (EAGLE-2's final selection).

    Candidate ``i`` carries ``tokens[i]``, its parent candidate ``parents[i]`` (-1: the root, and parents are
    recorded before their children) and ``scores[i]``, its path's cumulative log-prob, which never exceeds
    its parent's; so the top candidates, ties broken by recording order, always include their ancestors.
    """
    chosen = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    chosen.sort()
    index = {c: n + 1 for n, c in enumerate(chosen)}
    if any(parents[c] >= 0 and parents[c] not in index for c in chosen):
        raise ValueError("a candidate scores above its parent: scores must be cumulative log-probs")
    return Tree.from_lists([root, *(tokens[c] for c in chosen)], [-1, *(index.get(parents[c], 0) for c in chosen)])


# ---- Graft: dynamic-depth pruning, then retrieval grafted into the freed budget (docs/algorithms.md §7) ----
CONFIDENCES = ("mass", "best", "top1")


def frontier_confidence(scores: Sequence[float], parent_scores: Sequence[float], kind: str) -> float:
    """Confidence ``c_d`` of a drafter's frontier: should drafting go one depth further?

    ``scores`` are the frontier nodes' cumulative path log-probs under the drafter, ``parent_scores`` their
    parents'. Kinds:

    - ``mass``: ``Σ exp(score)``, the drafter's probability that the accepted path reaches some frontier node;
      drafting deeper can only pay off on that event, so it bounds the gain of the next forward.
    - ``best``: ``max exp(score)``, the probability of the single best path.
    - ``top1``: ``max exp(score - parent score)``, the most confident next-token probability at this depth,
      blind to how unlikely the prefix already is.
    """
    if not scores:
        return 0.0
    if kind == "mass":
        return math.exp(torch.tensor(scores, dtype=torch.float64).logsumexp(0).item())
    if kind == "best":
        return math.exp(max(scores))
    if kind == "top1":
        return math.exp(max(s - p for s, p in zip(scores, parent_scores, strict=True)))
    raise ValueError(f"unknown frontier confidence {kind!r}; choose from {CONFIDENCES}")


def ddtree_frontier(logprobs: torch.Tensor, depth: int, width: int) -> tuple[list[float], list[float]]:
    """The frontier at depth ``depth + 1`` of a tree grown from per-depth marginals (Shape: (D, V)): the greedy
    path through depth ``depth`` extended by the ``width`` best tokens of depth ``depth + 1``. Returns the
    frontier's path scores and their parents' (all the greedy prefix's), as :func:`frontier_confidence` takes."""
    prefix = logprobs[:depth].max(-1).values.sum().item() if depth else 0.0
    top = logprobs[depth].topk(min(width, logprobs.shape[-1])).values.tolist()
    return [prefix + v for v in top], [prefix] * len(top)


def pruned_depth(
    logprobs: torch.Tensor, checkpoints: Sequence[int], thresholds: Sequence[float], width: int, kind: str
) -> tuple[int, int]:
    """Dynamic-depth pruning of a tree grown from per-depth marginals (Shape: (D, V), row ``d`` = depth
    ``d + 1``): at checkpoint ``d`` (ascending) the frontier at depth ``d + 1`` is kept but nothing deeper when its
    confidence is below ``thresholds[s]``. Returns ``(stage, depth limit)``: the checkpoint index that pruned, or
    ``len(checkpoints)`` when none did (limit = every depth)."""
    depth_count = logprobs.shape[0]
    for stage, (d, threshold) in enumerate(zip(checkpoints, thresholds, strict=True)):
        if d + 1 >= depth_count:
            break
        scores, parents = ddtree_frontier(logprobs, d, width)
        if frontier_confidence(scores, parents, kind) < threshold:
            return stage, d + 1
    return len(checkpoints), depth_count


def merge_trie(base: Tree, extra: Tree, budget: int) -> Tree:
    """Graft ``extra`` (same root) into ``base`` as a trie, appending new nodes until ``budget`` draft nodes.

    ``base`` is kept whole. ``extra``'s nodes are taken in its own (topological) order: a node whose token
    already is a child of its mapped parent collapses into that child and costs nothing; any other node is
    appended, while the size is below ``budget``. A node whose parent was not taken is skipped with its subtree.
    So the result has ``min(budget, |base ∪ extra|)`` nodes, no duplicate siblings, parents before children,
    and extra's nodes beyond the first that fit are exactly the fill that replaces collapsed ones.
    """
    if int(extra.tokens[0]) != int(base.tokens[0]):
        raise ValueError(f"cannot merge trees with different roots {int(base.tokens[0])} and {int(extra.tokens[0])}")
    tokens, parents = base.tokens.tolist(), base.parents.tolist()
    children = base.children()
    mapped = [0] + [-1] * extra.size
    for i, (parent, token) in enumerate(zip(extra.parents.tolist()[1:], extra.tokens.tolist()[1:], strict=True), 1):
        at = mapped[parent]
        if at < 0:
            continue
        if token in children[at]:
            mapped[i] = children[at][token]
        elif len(tokens) <= budget:
            mapped[i] = len(tokens)
            children[at][token] = len(tokens)
            children.append({})
            tokens.append(token)
            parents.append(at)
    return Tree.from_lists(tokens, parents)
