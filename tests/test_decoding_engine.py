"""The engine end to end: greedy output of every builder equals the target's own greedy decoding; sampled
output follows the target's distribution; chain mode reproduces the dflash package's dflash_generate."""

import json
import time

import pytest
import torch
from conftest import ROOT, TINY_TARGET, chi2_pvalue, qwen3_config, reference_dflash_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.drafting import RecyclingSession
from trainer.decoding.engine import generate
from trainer.decoding.options import TreeOptions
from trainer.decoding.tree import Tree
from trainer.decoding.verify import Sampling
from trainer.drafters import load_drafter
from trainer.drafters.dflash import DFlashDraftModel, build_config
from trainer.drafters.eagle3 import Eagle3DraftModel
from trainer.drafters.eagle3 import build_config as eagle3_config
from trainer.drafters.specblock import SpecBlockDraftModel
from trainer.drafters.specblock import build_config as specblock_config
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.drafters.vocab import DraftVocab
from trainer.errors import UserError

# Graft pruned at its first checkpoint every step: one drafter forward, a quarter of the budget drafted, the
# rest grafted from the adjacency matrix.
ALWAYS_PRUNE = TreeOptions(graft_thresholds=(1.1, 1.1, 1.1))

DFLASH_TINY = ROOT / "checkpoints" / "dflash_tiny"


@pytest.fixture(scope="module")
def shipped():
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    dflash = load_drafter(DFLASH_TINY)
    # A TreeFlash drafter whose approximator is not the identity, so its trees differ from DDTree's.
    treeflash = TreeFlashDraftModel.from_dflash(str(DFLASH_TINY)).eval()
    torch.manual_seed(0)
    torch.nn.init.normal_(treeflash.ar_approximation.d.weight, std=0.05)
    lines = (ROOT / "data" / "prompts" / "stdlib_heldout.jsonl").read_text().splitlines()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"][-96:]  # noqa: E731
    prompts = [torch.tensor(encode(json.loads(line)["prompt"])) for line in lines[:8]]
    return target, dflash, treeflash, prompts


@pytest.fixture(scope="module")
def greedy_references(shipped):
    """The target's own greedy decoding (transformers' generate) of every prompt, 64 new tokens.

    End-of-text is an ordinary token here, as in ``generate`` without stop tokens: the first prompt is a whole
    module, where the target's argmax is end-of-text (``min_new_tokens`` would ban it instead)."""
    target, _, _, prompts = shipped
    eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = None
    try:
        outputs = [target.generate(p[None], max_new_tokens=64, do_sample=False) for p in prompts]
    finally:
        target.generation_config.eos_token_id = eos
    return [out[0, p.numel() :].tolist() for out, p in zip(outputs, prompts, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree,budget",
    [("none", 0), ("chain", 64), ("ddtree", 16), ("treeflash", 24), ("recycling", 32), ("graft-dflash", 32)],
)
def test_greedy_is_lossless_for_every_builder(shipped, greedy_references, tree, budget):
    target, dflash, treeflash, prompts = shipped
    drafter = treeflash if tree == "treeflash" else dflash
    taus = []
    for prompt, reference in zip(prompts, greedy_references, strict=True):
        session = make_session(tree, target, drafter)
        out = generate(target, session, BUILDERS[tree], prompt, 64, budget=budget)
        assert out.tokens == reference
        assert sum(s.committed for s in out.steps) == 63
        assert all(s.tree_size <= budget for s in out.steps)
        # Block drafters draft at most block_size - 1 depths (15 for the shipped backbone), whatever the budget.
        assert all(s.tree_depth <= 15 for s in out.steps)
        taus.append(out.tau)
    # Every drafter accepts something on this in-domain text (a broken tree or mask gives τ == 1).
    assert (min(taus) == 1.0) if tree == "none" else (sum(taus) / len(taus) > 1.2)


@pytest.mark.slow
def test_eagle_greedy_is_lossless(shipped, greedy_references):
    """A random EAGLE-3 drafter: its trees are rejected mostly, and every output must still be exact."""
    target, _, _, prompts = shipped
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(eagle3_config(target.config, draft_vocab_size=512)).eval()
    for budget in (16, 60):
        for prompt, reference in zip(prompts[:4], greedy_references, strict=False):
            out = generate(target, make_session("eagle", target, drafter), BUILDERS["eagle"], prompt, 32, budget)
            assert out.tokens == reference[:32]
            remaining = 31
            for step in out.steps:
                # Depth is capped by the tokens still to produce; one level holds only EAGLE's top 10.
                assert step.tree_size == (min(budget, 10) if remaining == 1 else budget)
                remaining -= step.committed
            # One forward enters the context, then one per depth up to EAGLE's 7.
            assert out.steps[0].forwards == 7


def test_graft_greedy_is_lossless(shipped, greedy_references):
    """Graft over a random EAGLE-3 drafter, unpruned (the threshold 0 never prunes) and pruned at the root
    every step, with one adjacency matrix learnt across the prompts."""
    target, _, _, prompts = shipped
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(eagle3_config(target.config, draft_vocab_size=512)).eval()
    never = TreeOptions(graft_thresholds=(0.0, 0.0, 0.0))
    for options in (never, ALWAYS_PRUNE):
        memory = RecyclingSession(target.config.vocab_size)
        sizes = []
        for prompt, reference in zip(prompts[:4], greedy_references, strict=False):
            session = make_session("graft", target, drafter, options, memory)
            out = generate(target, session, BUILDERS["graft"], prompt, 32, 32, options=options)
            assert out.tokens == reference[:32]
            assert all(s.tree_size <= 32 for s in out.steps)
            sizes += [s.tree_size for s in out.steps]
            if options is ALWAYS_PRUNE:
                assert all(s.forwards == 1 for s in out.steps)
                # Every step but a last one with a single token left (no checkpoint to reach) pruned at d0.
                assert session.stages[0] >= len(out.steps) - 1
            else:
                assert out.steps[0].forwards == 7 and out.steps[0].tree_size == 32
        # Retrieval fills the budget unless the matrix rows it reaches are still empty.
        assert sum(sizes) / len(sizes) > 0.8 * 32
        assert (memory.adjacency[:, 0] >= 0).sum() > 100, "the matrix did not learn from verified nodes"


def test_set_adjacency_keeps_rows_learnt_since_the_last_load():
    memory = RecyclingSession(6, width=2)
    memory.adjacency[1] = torch.tensor([2, 3])
    memory.adjacency[4] = torch.tensor([5, 0])
    published = torch.full((6, 3), -1, dtype=torch.int32)
    published[1] = torch.tensor([4, 5, -1], dtype=torch.int32)
    published[2] = torch.tensor([1, -1, -1], dtype=torch.int32)
    memory.set_adjacency(published, version=3)
    # Rows learnt here since the last load are kept (padded to the snapshot's width); the snapshot fills the rest.
    assert memory.adjacency.tolist() == [[-1, -1, -1], [2, 3, -1], [1, -1, -1], [-1, -1, -1], [5, 0, -1], [-1] * 3]
    assert memory.adjacency.dtype == torch.long and memory.version == 3
    # At the next load, rows unchanged since are the snapshot's to replace.
    memory.set_adjacency(published, version=4)
    assert memory.adjacency.tolist() == published.tolist() and memory.version == 4
    with pytest.raises(UserError, match=r"shape \(6, k\)"):
        memory.set_adjacency(torch.zeros(5, 3, dtype=torch.long), version=5)
    with pytest.raises(UserError, match="outside"):
        memory.set_adjacency(torch.full((6, 3), 6), version=5)
    assert memory.version == 4
    # Learning goes on over a loaded matrix.
    memory.commit([], None, Tree.from_lists([3], [-1]), torch.tensor([[0.1, 0.0, 0.0, 0.0, 1.0, 2.0]]))
    assert memory.adjacency[3].tolist() == [5, 4, 0]


# The growth before the authors' code was followed: class 3 ends the walk, no forced root width, three rounds.
OLD_GROWTH = TreeOptions(
    specblock_branch=(1, 4, 10, 0),
    specblock_root_width=None,
    specblock_stop="chain",
    specblock_launch_greedy=False,
    specblock_rounds=3,
    specblock_blocks_per_round=8,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "alignment,options,prompts_used",
    [("next", TreeOptions(), 4), ("same", TreeOptions(), 2), ("next", OLD_GROWTH, 2), ("same", OLD_GROWTH, 2)],
)
def test_specblock_greedy_is_lossless(shipped, greedy_references, alignment, options, prompts_used):
    """A random SpecBlock drafter (random rank classes, so branching, stops and launches all occur)."""
    target, _, _, prompts = shipped
    torch.manual_seed(0)
    drafter = SpecBlockDraftModel(specblock_config(target.config, alignment=alignment)).eval()
    # The root block costs the context forward under `next`, one more forward under `same`.
    root_forwards = 1 if alignment == "next" else 2
    for budget in (16, 60):
        for prompt, reference in zip(prompts[:prompts_used], greedy_references, strict=False):
            session = make_session("specblock", target, drafter, options)
            out = generate(target, session, BUILDERS["specblock"], prompt, 32, budget, options=options)
            assert out.tokens == reference[:32]
            assert all(0 <= s.tree_size <= budget for s in out.steps)
            assert all(root_forwards <= s.forwards < root_forwards + options.specblock_rounds for s in out.steps)
            if options.specblock_stop == "branching":
                # The root block's slot 0 always branches and greedy tokens always stay: never an empty tree.
                assert all(s.tree_size >= min(budget, options.specblock_root_width) for s in out.steps)
            else:
                # A root slot of rank class 3 (">10") ends the walk there, so a tree may be empty.
                assert any(s.tree_size > 0 for s in out.steps)


@pytest.mark.slow
def test_chain_matches_dflash_generate(shipped, monkeypatch):
    dflash_model = reference_dflash_model()
    # The reference times with CUDA synchronisation; the wall clock is enough on CPU.
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    target, _, _, prompts = shipped
    reference_drafter = dflash_model.DFlashDraftModel.from_pretrained(DFLASH_TINY, dtype=torch.float32).eval()
    ours = load_drafter(DFLASH_TINY)
    for prompt in prompts[:4]:
        with torch.no_grad():
            ref = dflash_model.dflash_generate(
                reference_drafter, target, prompt[None], 64, stop_token_ids=None, return_stats=True
            )
        out = generate(target, make_session("chain", target, ours), BUILDERS["chain"], prompt, 64, budget=15)
        assert out.tokens == ref.output_ids[0, prompt.numel() :].tolist()
        assert [s.committed for s in out.steps] == ref.acceptance_lengths


@pytest.fixture(scope="module")
def small_vocab():
    """A random target over 12 tokens with moderately peaked distributions, and random drafters for it."""
    torch.manual_seed(3)
    config = qwen3_config(4, vocab_size=12, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    dflash = DFlashDraftModel(build_config(config, 1, 4, mask_token_id=11)).eval()
    treeflash = TreeFlashDraftModel.from_dflash(dflash).eval()
    torch.nn.init.normal_(treeflash.ar_approximation.d.weight, std=0.5)
    eagle = Eagle3DraftModel(eagle3_config(config, draft_vocab_size=12)).eval()
    specblock = SpecBlockDraftModel(specblock_config(config, target_layer_ids=[0, 1, 2])).eval()
    # An own head over 10 of the 12 tokens, mapped by a non-trivial d2t (ids 2..11).
    own_head = SpecBlockDraftModel(specblock_config(config, target_layer_ids=[0, 1, 2], draft_vocab_size=10)).eval()
    own_head.set_draft_vocab(DraftVocab.from_counts(torch.arange(12), 10))
    drafters = {"chain": dflash, "ddtree": dflash, "recycling": None, "treeflash": treeflash, "eagle": eagle}
    return target, {
        **drafters,
        "specblock": specblock,
        "specblock_own_head": own_head,
        "graft": eagle,
        "graft-dflash": dflash,
    }


def exact_marginals(target, prompt: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Distributions of the 2nd and 3rd generated tokens under plain sampling, by enumeration."""
    v = target.config.vocab_size
    with torch.no_grad():
        p1 = sampling.probs(target(prompt[None]).logits[0, -1])
        seq1 = torch.cat([prompt.expand(v, -1), torch.arange(v)[:, None]], dim=1)
        p2_given = sampling.probs(target(seq1).logits[:, -1])  # (x1, x2)
        joint12 = p1[:, None] * p2_given
        seq2 = torch.cat([seq1.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], dim=1)
        p3_given = sampling.probs(target(seq2).logits[:, -1]).view(v, v, v)
        p3 = (joint12[..., None] * p3_given).sum((0, 1))
    return joint12.sum(0), p3


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree,sampling,options",
    [
        ("chain", Sampling(temperature=1.0), TreeOptions()),
        ("ddtree", Sampling(temperature=0.7, top_k=6), TreeOptions()),
        ("treeflash", Sampling(temperature=1.0, top_p=0.9), TreeOptions()),
        ("recycling", Sampling(temperature=1.0), TreeOptions()),
        ("eagle", Sampling(temperature=1.0), TreeOptions()),
        ("specblock", Sampling(temperature=1.0), TreeOptions()),
        ("specblock_own_head", Sampling(temperature=0.7), TreeOptions()),
        ("graft", Sampling(temperature=1.0), ALWAYS_PRUNE),
        ("graft-dflash", Sampling(temperature=0.7), ALWAYS_PRUNE),
    ],
)
def test_sampling_follows_the_target_distribution(small_vocab, tree, sampling, options):
    target, drafters = small_vocab
    drafter = drafters[tree]
    tree = tree.removesuffix("_own_head")
    prompt = torch.tensor([1, 5, 2, 7])
    p2, p3 = exact_marginals(target, prompt, sampling)
    counts2 = torch.zeros(12, dtype=torch.long)
    counts3 = torch.zeros(12, dtype=torch.long)
    accepted = 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(800):
        session = make_session(tree, target, drafter, options)
        out = generate(target, session, BUILDERS[tree], prompt, 3, 8, sampling, gen, options=options)
        counts2[out.tokens[1]] += 1
        counts3[out.tokens[2]] += 1
        accepted += out.steps[0].accepted
    assert accepted > 40, "drafts were never accepted: the test would not exercise acceptance"
    assert chi2_pvalue(counts2, p2) > 1e-3
    assert chi2_pvalue(counts3, p3) > 1e-3
