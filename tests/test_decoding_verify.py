"""Tree verification as pure functions: the attention mask against sequential decoding, greedy and sampled
acceptance, warping, the commit and finish rules that both engines share, and KV compaction."""

import pytest
import torch
from conftest import chi2_pvalue
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from trainer.decoding.drafting import DraftSession, commit_verdict
from trainer.decoding.tree import Tree
from trainer.decoding.verify import (
    GREEDY,
    GrowingLayer,
    Sampling,
    accept,
    compact_cache,
    finish_reason,
    growing_cache,
    tree_attention_mask,
    verify_tree,
)


@pytest.mark.parametrize("make_cache", [lambda c: DynamicCache(config=c), growing_cache], ids=["dynamic", "growing"])
def test_tree_mask_matches_sequential_decoding(tiny_qwen3, make_cache):
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        full = tiny_qwen3(ids).logits[0]
        cache = make_cache(tiny_qwen3.config)
        tiny_qwen3(ids[:, :8], cache=cache, use_cache=True)
        # Root ids[8] with two branches: the true continuation ids[9], ids[10] and a decoy 5 → 6.
        tree = Tree.from_lists([int(ids[0, 8]), int(ids[0, 9]), 5, int(ids[0, 10]), 6], [-1, 0, 0, 1, 2])
        mask = tree_attention_mask(tree, 8, torch.float32, torch.device("cpu"))
        out = tiny_qwen3(
            tree.tokens[None], position_ids=(8 + tree.depths())[None], attention_mask=mask, cache=cache, use_cache=True
        ).logits[0]
    torch.testing.assert_close(out[[0, 1, 3]], full[[8, 9, 10]], atol=1e-4, rtol=1e-4)
    # Compacting to the true branch leaves exactly the cache of the sequential prefix.
    compact_cache(cache, 8, [0, 1, 3])
    assert cache.get_seq_length() == 11
    with torch.no_grad():
        nxt = tiny_qwen3(ids[:, 11:12], cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(nxt, full[11], atol=1e-4, rtol=1e-4)


def test_growing_layer_holds_what_a_dynamic_layer_holds():
    """Appends past the buffer's capacity, crops, compactions that move positions and appends after them leave
    a growing layer with the keys a concatenating layer has, and compaction copies only the moved positions."""
    torch.manual_seed(0)
    grown, plain = GrowingLayer(), DynamicLayer()
    lengths = [200, 16, 16, 40, 300, 5]
    for step, n in enumerate(lengths):
        keys, values = torch.randn(2, 1, 2, n, 4).unbind(0)
        for layer in (grown, plain):
            out = layer.update(keys, values)
        torch.testing.assert_close(out[0], plain.keys, rtol=0, atol=0)
        past = plain.keys.shape[-2] - n
        keep = [0, 2, 3] if step % 2 else list(range(min(n, 5)))
        for layer in (grown, plain):
            cache = DynamicCache()
            cache.layers = [layer]
            compact_cache(cache, past, keep)
        torch.testing.assert_close(grown.keys, plain.keys, rtol=0, atol=0)
        torch.testing.assert_close(grown.values, plain.values, rtol=0, atol=0)
    # The cache stays a view of one buffer: nothing behind the kept positions was reallocated by a compaction.
    assert grown.keys.data_ptr() == grown._key_buffer.data_ptr() and grown._key_buffer.shape[-2] >= 256


def test_greedy_acceptance_walks_the_argmax():
    tree = Tree.from_lists([0, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    logits = torch.zeros(5, 8)
    logits[0, 1] = 1  # root → 1 (node 1)
    logits[1, 4] = 1  # node 1 → 4 (node 4)
    logits[4, 7] = 1  # node 4 → bonus 7
    result = accept(tree, logits, GREEDY)
    assert result.path == [0, 1, 4] and result.bonus == 7 and result.accepted == 2
    logits[0] = 0
    logits[0, 6] = 1  # no child carries 6
    result = accept(tree, logits, GREEDY)
    assert result.path == [0] and result.bonus == 6


class Recorder(DraftSession):
    def __init__(self, layer_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.layer_ids = layer_ids
        self.commits: list[tuple[list[int], torch.Tensor | None]] = []

    def commit(self, tokens: list[int], features: torch.Tensor | None, tree: Tree, logits: torch.Tensor) -> None:
        self.commits.append((tokens, features))


def test_a_verdict_commits_to_its_cut_and_the_request_ends_by_the_same_rule():
    """A chain root → 1 → 2 → 3 all accepted, bonus 7: cut to ``remaining`` or at a stop token, the sessions are
    told the root and the kept drafts with their layer set's features, the tokens grow by the cut, and
    ``finish_reason`` ends the request exactly where the cut did."""
    tree = Tree.from_lists([5, 1, 2, 3], [-1, 0, 1, 2])
    logits = torch.eye(8)[[1, 2, 3, 7]]
    features = {(0, 2): torch.arange(8.0)[:, None]}
    for remaining, stops, new, reason in [(9, set(), [1, 2, 3, 7], None), (2, set(), [1, 2], "length"),
                                          (9, {2}, [1, 2], "stop"), (1, {7}, [1], "length")]:  # fmt: skip
        verdict = verify_tree(tree, logits, GREEDY, None, remaining, stops)
        tokens = [5]  # the request's new tokens: the prefill's, the root of this step
        plain, reader = Recorder(()), Recorder((0, 2))
        commit_verdict(verdict, tokens, [plain, reader], {k: v[: len(new)] for k, v in features.items()}, tree, logits)
        assert verdict.new == new and verdict.path == list(range(len(new)))
        assert plain.commits == [([5, *new[:-1]], None)] and reader.commits[0][0] == [5, *new[:-1]]
        assert reader.commits[0][1].flatten().tolist() == list(range(len(new)))
        assert tokens == [5, *new]
        assert finish_reason(tokens, 1 + remaining, stops) == reason


def test_sampled_acceptance_follows_the_target_distribution():
    torch.manual_seed(0)
    vocab = 6
    tree = Tree.from_lists([0, 1, 2, 3], [-1, 0, 0, 1])
    logits = torch.randn(4, vocab) * 1.5
    sampling = Sampling(temperature=0.8)
    probs = sampling.probs(logits)
    gen = torch.Generator().manual_seed(0)
    first = torch.zeros(vocab, dtype=torch.long)
    second_after_1 = torch.zeros(vocab, dtype=torch.long)
    for _ in range(6000):
        r = accept(tree, logits, sampling, gen)
        tokens = [int(tree.tokens[i]) for i in r.path[1:]] + [r.bonus]
        first[tokens[0]] += 1
        if tokens[0] == 1:
            second_after_1[tokens[1]] += 1
    assert chi2_pvalue(first, probs[0]) > 1e-3
    # After token 1 (node 1), the next token must follow node 1's row, accepted into node 3 or not.
    assert chi2_pvalue(second_after_1, probs[1]) > 1e-3
    # The test has power: the draft-agnostic wrong answer (node 2's row) is rejected.
    assert chi2_pvalue(second_after_1, probs[2]) < 1e-6


def test_draw_follows_the_probabilities_and_never_draws_a_zero(monkeypatch):
    from trainer.sampling import draw

    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([draw(probs, gen) for _ in range(6000)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chi2_pvalue(counts[[1, 3, 4]], probs[[1, 3, 4]]) > 1e-3
    # Unnormalised weights draw the same; the same seed draws the same sequence.
    first, second = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert [int(draw(probs * 7, first)) for _ in range(50)] == [int(draw(probs, second)) for _ in range(50)]
    # A uniform draw that rounds up to the total takes the last positive probability, not the zero after it.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert int(draw(probs)) == 4


def test_warping_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = Sampling(temperature=1.0, top_k=2).probs(logits)
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = Sampling(temperature=1.0, top_p=0.8).probs(logits)
    kept = int((p > 0).sum())
    assert full[: kept - 1].sum() < 0.8 <= full[:kept].sum()
    torch.testing.assert_close(p[:kept], full[:kept] / full[:kept].sum())
