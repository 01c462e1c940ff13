"""Tree builders as pure functions: budgets, invariants, and optimality against brute force."""

import itertools
import math

import pytest
import torch

from trainer.decoding.tree import (
    NestedTree,
    Transitions,
    Tree,
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
from trainer.decoding.verify import Sampling, accept


def surrogate(tree: Tree, score) -> float:
    """Σ over nodes of the product of q along the node's path (the expected acceptance length surrogate)."""
    total, path_lp = 0.0, [0.0] * (tree.size + 1)
    for i in range(1, tree.size + 1):
        path_lp[i] = path_lp[int(tree.parents[i])] + score(tree, i)
        total += math.exp(path_lp[i])
    return total


def test_tree_helpers():
    tree = Tree.from_lists([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    tree.validate()
    assert tree.size == 4
    assert tree.depths().tolist() == [0, 1, 1, 2, 3]
    mask = tree.ancestor_mask()
    assert mask[4].tolist() == [True, True, False, True, True]
    assert mask[2].tolist() == [True, False, True, False, False]
    assert tree.children()[0] == {1: 1, 2: 2}
    with pytest.raises(ValueError, match="duplicates"):
        Tree.from_lists([9, 1, 1], [-1, 0, 0]).validate()
    with pytest.raises(ValueError, match="precede"):
        Tree.from_lists([9, 1, 2], [-1, 2, 0]).validate()


def test_chain_and_root_only():
    tree = chain(7, torch.tensor([3, 4, 5, 6]), budget=3)
    assert tree.tokens.tolist() == [7, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert root_only(7).size == 0


@pytest.mark.parametrize("budget", [1, 3, 6, 10])
def test_ddtree_is_the_best_tree_of_its_size(budget):
    torch.manual_seed(budget)
    depth, vocab = 3, 4
    lp = (torch.randn(depth, vocab) * 2).log_softmax(-1)
    tree = ddtree(lp, root=99, budget=budget)
    tree.validate()
    assert tree.size == min(budget, sum(vocab**d for d in range(1, depth + 1)))
    depths = tree.depths()
    q = lambda t, i: float(lp[int(depths[i]) - 1, int(t.tokens[i])])  # noqa: E731
    best = surrogate(tree, q)
    # Brute force over every subtree of the full 3-level tree with `budget` nodes that is closed under parents.
    nodes = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
    if budget <= 3:
        for subset in itertools.combinations(nodes, budget):
            chosen = set(subset)
            if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
                value = sum(math.exp(sum(float(lp[d, t]) for d, t in enumerate(p))) for p in chosen)
                assert value <= best + 1e-9
    # Greedy optimality holds for every size: each popped node is the best frontier node.
    prev = float("inf")
    for i in range(1, tree.size + 1):
        path_q = math.exp(sum(q(tree, j) for j in range(1, i + 1) if tree.ancestor_mask()[i, j]))
        assert path_q <= prev + 1e-9
        prev = path_q


def test_treeflash_children_come_from_their_own_transition_row():
    # Two slots, M = 2 candidates, K = 2 transitions. Slot 1 (root's child): tokens 10 (lp -0.1), 11 (-2.5).
    # Slot 2 rows: after candidate 10 → [20, 21]; after candidate 11 → [30, 31].
    candidates = torch.tensor([[10, 11], [20, 30]])
    tokens = torch.tensor([[[10, 11], [10, 11]], [[20, 21], [30, 31]]])
    logprobs = torch.tensor([[[-0.1, -2.5], [-0.1, -2.5]], [[-0.2, -1.0], [-0.05, -3.0]]])
    tables = Transitions.from_candidates(candidates, tokens, logprobs)
    assert tables.next_index[0, 0].tolist() == [0, 1]  # 10 is candidate 0, 11 candidate 1 of slot 1
    assert (tables.next_index[1] == -1).all()
    tree = treeflash(tables, root=5, budget=4)
    tree.validate()
    pairs = {(int(tree.tokens[tree.parents[i]]), int(tree.tokens[i])) for i in range(1, tree.size + 1)}
    # Scores: 10: -0.1, 10→20: -0.3, 10→21: -1.1, 11: -2.5, 11→30: -2.55 — the best four.
    assert pairs == {(5, 10), (10, 20), (10, 21), (5, 11)}
    # A marginal-only DDTree would have put 30 under 11; TreeFlash never does (30 follows 11 only).
    assert all(not (p == 10 and c == 30) for p, c in pairs)


def test_treeflash_unexpandable_nodes_stay_leaves():
    candidates = torch.tensor([[10, 11], [20, 21]])
    tokens = torch.tensor([[[12, 10], [12, 10]], [[20, 21], [22, 23]]])  # 12 is not a slot-1 candidate
    logprobs = torch.tensor([[[-0.1, -0.2], [-0.1, -0.2]], [[-0.1, -0.2], [-0.1, -0.2]]])
    tables = Transitions.from_candidates(candidates, tokens, logprobs)
    tree = treeflash(tables, root=5, budget=10)
    children = tree.children()
    node_12 = children[0][12]
    assert children[node_12] == {}
    assert set(children[children[0][10]]) == {20, 21}


def test_recycling_template_shape():
    template = recycling_template(80)
    assert len(template) == 80 and len(set(template)) == 80
    assert all(p[:-1] in set(template) for p in template if len(p) > 1)
    per_depth = [sum(len(p) == d for p in template) for d in range(1, 7)]
    assert per_depth[0] <= 8 and per_depth[1] > per_depth[0] and per_depth[-1] < per_depth[2]
    assert set(recycling_template(16)) <= set(recycling_template(80))


def test_retrieval_fills_from_adjacency_and_skips_unknown_and_duplicates():
    adjacency = torch.full((10, 3), -1, dtype=torch.long)
    adjacency[5] = torch.tensor([1, 2, 2])
    adjacency[1] = torch.tensor([3, 4, -1])
    template = [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0)]
    tree = retrieval(adjacency, root=5, template=template)
    tree.validate()
    pairs = [(int(tree.tokens[tree.parents[i]]), int(tree.tokens[i])) for i in range(1, tree.size + 1)]
    # (2,) duplicates token 2, (0, 2) is unknown, (1, 0) hangs under 2 whose row is unknown, 3's row is unknown.
    assert pairs == [(5, 1), (5, 2), (1, 3), (1, 4)]


@pytest.mark.parametrize("seed", range(6))
def test_a_nested_retrieval_tree_tells_what_every_smaller_budget_would_have_accepted(seed):
    # A sparse adjacency with unknown (-1) and repeated successors, so retrieval drops paths in both trees.
    g = torch.Generator().manual_seed(seed)
    vocab, width, shape = 12, 4, (32, 4, 0.5, 5)
    adjacency = torch.randint(-1, vocab, (vocab, width), generator=g)
    max_depth = 3 + seed % 3
    big = retrieval(adjacency, 7, [p for p in recycling_template(*shape) if len(p) <= max_depth], prior_ranks(*shape))
    assert isinstance(big, NestedTree)

    def logits_of(tree: Tree) -> torch.Tensor:
        # The target's logits after a node depend on the tokens from the root to it, not on the node's index; it
        # leans to the adjacency's successors of the node's token, so walks go a few nodes deep.
        rows = []
        for i in range(tree.size + 1):
            context, node = [], i
            while node >= 0:
                context.append(int(tree.tokens[node]))
                node = int(tree.parents[node])
            row = torch.randn(vocab, generator=torch.Generator().manual_seed(hash(tuple(context)) % 2**31))
            known = adjacency[context[0]]
            row[known[known >= 0]] += 2.0
            rows.append(row)
        return torch.stack(rows)

    cut_short = 0
    for budget in (1, 4, 8, 16):
        small = retrieval(adjacency, 7, [p for p in recycling_template(budget, *shape[1:]) if len(p) <= max_depth])
        # The nodes of rank at most ``budget`` are that budget's tree, in the same order.
        inside = big.budgets <= budget
        assert torch.equal(big.tokens[inside], small.tokens)
        for draw in range(8):
            sampling = Sampling(1.0, 1.0, 0)
            walk = accept(big, logits_of(big), sampling, torch.Generator().manual_seed(draw))
            alone = accept(small, logits_of(small), sampling, torch.Generator().manual_seed(draw))
            assert big.within(walk.path, budget) == (len(alone.path), int(small.depths().max()))
            cut_short += len(alone.path) < len(walk.path)
    assert cut_short > 0


def test_template_by_prior_prefixes_are_the_templates():
    order = template_by_prior(40, 8, 0.5, 6)
    for size in (1, 7, 16, 40):
        assert set(order[:size]) == set(recycling_template(size))
    # Every prefix is a tree: a path's parent comes before it.
    assert all(p[:-1] in set(order[:i]) for i, p in enumerate(order) if len(p) > 1)


def paths(tree: Tree) -> set[tuple[int, ...]]:
    """Every node as its token path from the root (a trie's identity)."""
    out, path = set(), {0: ()}
    for i in range(1, tree.size + 1):
        path[i] = (*path[int(tree.parents[i])], int(tree.tokens[i]))
        out.add(path[i])
    return out


def test_merge_trie_collapses_coinciding_paths_and_fills_to_the_budget():
    draft = Tree.from_lists([9, 1, 2, 3], [-1, 0, 0, 1])  # paths (1), (2), (1, 3)
    # Retrieval: (1) and (1, 3) coincide with drafted paths, (2, 5) hangs under a drafted node, (4) is new.
    extra = Tree.from_lists([9, 1, 4, 3, 7, 2, 5, 6], [-1, 0, 0, 1, 1, 0, 5, 2])
    merged = merge_trie(draft, extra, budget=6)
    merged.validate()
    assert merged.size == 6
    assert merged.tokens[:4].tolist() == [9, 1, 2, 3] and merged.parents[:4].tolist() == [-1, 0, 0, 1]
    # The three collapsed retrieval nodes cost nothing: the fill reaches (2, 5) in retrieval order.
    assert paths(merged) == {(1,), (2,), (1, 3), (4,), (1, 7), (2, 5)}
    # A smaller budget takes extra's nodes in order and skips the subtree of a node that did not fit.
    small = merge_trie(draft, extra, budget=4)
    assert paths(small) == {(1,), (2,), (1, 3), (4,)}
    # A budget above the union: everything once.
    assert paths(merge_trie(draft, extra, budget=50)) == paths(draft) | paths(extra)
    with pytest.raises(ValueError, match="different roots"):
        merge_trie(draft, root_only(8), budget=6)


@pytest.mark.parametrize("seed", range(5))
def test_merge_trie_is_the_union_as_a_trie(seed):
    g = torch.Generator().manual_seed(seed)
    adjacency = torch.randint(0, 6, (6, 3), generator=g)
    draft = retrieval(adjacency, 0, recycling_template(10, 3))
    other = torch.randint(0, 6, (6, 3), generator=g)
    extra = retrieval(other, 0, template_by_prior(30, 3, 0.5, 4))
    for budget in (draft.size, draft.size + 5, 100):
        merged = merge_trie(draft, extra, budget)
        merged.validate()
        union = paths(draft) | paths(extra)
        assert merged.size == min(budget, len(union))
        assert paths(draft) <= paths(merged) <= union


def test_frontier_confidence_kinds():
    scores = [math.log(0.3), math.log(0.1)]
    parents = [math.log(0.5), math.log(0.5)]
    assert frontier_confidence(scores, parents, "mass") == pytest.approx(0.4)
    assert frontier_confidence(scores, parents, "best") == pytest.approx(0.3)
    assert frontier_confidence(scores, parents, "top1") == pytest.approx(0.6)
    assert frontier_confidence([], [], "mass") == 0.0
    with pytest.raises(ValueError, match="unknown"):
        frontier_confidence(scores, parents, "entropy")


def test_pruned_depth_stops_at_the_first_low_checkpoint():
    # Depth 1 confident (0.9), depth 2 confident given it (0.9), depth 3 uniform over 10 tokens.
    probs = torch.full((4, 10), 0.1 / 9)
    probs[0, 0] = probs[1, 1] = 0.9
    probs[2:] = 0.1
    lp = probs.log()
    # Checkpoint 0 judges depth 1 (best path 0.9), checkpoint 2 judges depth 3 (0.81 * 0.1).
    assert pruned_depth(lp, (0, 2), (0.5, 0.5), width=1, kind="best") == (1, 3)
    assert pruned_depth(lp, (0, 2), (0.95, 0.5), width=1, kind="best") == (0, 1)
    assert pruned_depth(lp, (0, 2), (0.5, 0.05), width=1, kind="best") == (2, 4)
    # The frontier's mass over all 10 tokens at depth 3 is the greedy prefix's 0.81.
    assert pruned_depth(lp, (2,), (0.8,), width=10, kind="mass") == (1, 4)
    # A checkpoint at or past the last drafted depth never prunes.
    assert pruned_depth(lp, (3, 5), (1.0, 1.0), width=1, kind="best") == (2, 4)
