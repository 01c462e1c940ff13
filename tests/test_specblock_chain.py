"""The ``specblock-chain`` builder: SpecBlock's chain as vLLM serves it (root block, then blocks launched from each
block's last slot), checked against the drafter called by hand, on the shipped tiny models (CPU, fp32)."""

import json

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from trainer.decoding.builders import BUILDERS, DEFAULT_OPTIONS, make_session
from trainer.decoding.drafting import specblock_chains
from trainer.decoding.engine import generate
from trainer.decoding.events import Clock
from trainer.drafters import load_drafter
from trainer.drafters.specblock import launch_mask

DRAFTER = ROOT / "checkpoints" / "specblock_tiny"
PROMPTS = ROOT / "data" / "prompts" / "stdlib_heldout.jsonl"
# Three blocks of K = 4: the root block and two launched ones, the last cut to one slot.
LENGTH = 9
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    drafter = load_drafter(DRAFTER).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    lines = PROMPTS.read_text().splitlines()[:4]
    prompts = [torch.tensor(tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"])
               for line in lines]  # fmt: skip
    return target, drafter, prompts


def by_hand(target, drafter, prompt: torch.Tensor, length: int, shift: int = 0) -> tuple[list[int], list[torch.Tensor]]:
    """The chain from the drafter's forward, written out, and every block's pre-norm slot states (K, H): context
    blocks (f_i, x_{i+1}) at positions 1..P whose last is the root block, then each next block launched from the
    previous block's last slot with its greedy token at that token's position (``shift`` moves that position: a
    wrong launch for the test to tell apart), seeing every cached key (the context and the blocks before it)."""
    k = drafter.block_size
    with torch.no_grad():
        out = target(prompt[None], output_hidden_states=True)
        root = int(out.logits[0, -1].argmax())
        feats = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        embed = target.get_input_embeddings()
        cache = DynamicCache(config=drafter.config)
        tokens = torch.cat([prompt[1:], torch.tensor([root])])[None]
        n = prompt.numel()
        block = drafter(drafter.project_features(feats), embed(tokens), torch.arange(1, n + 1)[None],
                        past_key_values=cache)[0, -1]  # fmt: skip
        position, chain, blocks = n, [], [block]
        while True:
            greedy = drafter.to_target(drafter.logits(drafter.norm(block), target.lm_head).argmax(-1))
            chain += greedy.tolist()
            if len(chain) >= length:
                return chain[:length], blocks
            position += k
            visible = torch.ones(1, 1, cache.get_seq_length(), dtype=torch.bool)
            launched = torch.tensor([[position + shift]])
            block = drafter(block[None, None, -1], embed(greedy[None, -1:]), launched, launch_mask(visible, k), cache)
            block = block[0, 0]
            blocks.append(block)


def test_chain_launches_each_block_from_the_last_slot(models):
    target, drafter, prompts = models
    drafted: list[torch.Tensor] = []
    # Every drafter forward's newest block: the root block of the context forward, then each launched block
    # (cleared before the chain is drafted).
    hook = drafter.register_forward_hook(lambda module, args, out: drafted.append(out[0, -1]))
    for prompt in prompts:
        expected, blocks = by_hand(target, drafter, prompt, LENGTH)
        session = make_session("specblock-chain", target, drafter)
        g = generate(target, session, BUILDERS["specblock-chain"], prompt, 1, LENGTH)
        # generate stops before drafting for one token; the first step's chain from the session the prefill fed,
        # whose root is the prefill's greedy token.
        assert g.tokens == [int(target(prompt[None]).logits[0, -1].argmax())]
        drafted.clear()
        with torch.inference_mode():  # as generate drafts: the session's features are inference tensors
            tree = BUILDERS["specblock-chain"].build(session, g.tokens[0], LENGTH, LENGTH, Clock(CPU), DEFAULT_OPTIONS)
        assert tree.tokens[1:].tolist() == expected
        assert tree.parents.tolist() == list(range(-1, LENGTH))
        assert session.forwards == len(drafted) == len(blocks) == 3
        for ours, theirs in zip(drafted, blocks, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        # A block launched one position off drafts other states: the comparison above tells a wrong launch apart.
        _, shifted = by_hand(target, drafter, prompt, LENGTH, shift=1)
        assert not torch.allclose(shifted[1], blocks[1], rtol=1e-4, atol=1e-4)
    hook.remove()


def started(target, drafter, prompts, new_tokens: list[int]) -> tuple[list, list[int]]:
    """Sessions that decoded ``new_tokens[b]`` tokens after ``prompts[b]`` (a context cached, the last step's
    features pending), and their next roots."""
    sessions, roots = [], []
    for prompt, n in zip(prompts, new_tokens, strict=True):
        session = make_session("specblock-chain", target, drafter)
        roots.append(generate(target, session, BUILDERS["specblock-chain"], prompt, n, 8).tokens[-1])
        sessions.append(session)
    return sessions, roots


def test_chains_of_ragged_sessions_in_one_forward_per_round_equal_each_alone(models):
    target, drafter, prompts = models
    new_tokens, lengths = [1, 7, 12, 4], [9, 9, 5, 0]
    alone, roots = started(target, drafter, prompts, new_tokens)
    batch, _ = started(target, drafter, prompts, new_tokens)
    before = [s.forwards for s in batch]
    outputs: list[torch.Tensor] = []
    hook = drafter.register_forward_hook(lambda module, args, out: outputs.append(out[:, -1]))
    with torch.inference_mode():
        expected = []
        for session, root, n in zip(alone, roots, lengths, strict=True):
            outputs.clear()
            expected.append((session.chain(root, n), list(outputs)))
        outputs.clear()
        drafted = specblock_chains(batch, roots, lengths)
    hook.remove()
    assert drafted == [tokens for tokens, _ in expected] and [len(c) for c in drafted] == lengths
    # Each launched round's blocks, row by row, are the blocks each session launched alone.
    for round_, batched in enumerate(outputs[1:], start=1):
        rows = [b for b, n in enumerate(lengths) if n > round_ * drafter.block_size]
        alone_blocks = torch.cat([expected[b][1][round_] for b in rows])
        torch.testing.assert_close(batched, alone_blocks, rtol=1e-5, atol=1e-5)
    # One forward enters every context and drafts the root blocks, one more per launched round.
    assert [s.forwards - f for s, f in zip(batch, before, strict=True)] == [3, 3, 2, 1]
    for ours, theirs in zip(batch, alone, strict=True):
        assert ours.cache.get_seq_length() == theirs.cache.get_seq_length() == ours.entered * drafter.block_size
        torch.testing.assert_close(ours.cache.layers[0].keys, theirs.cache.layers[0].keys, rtol=1e-4, atol=1e-4)


def test_chain_decodes_losslessly_with_one_forward_per_block(models):
    target, drafter, prompts = models
    plain = generate(target, make_session("none", target, None), BUILDERS["none"], prompts[0], 24, 0).tokens
    session = make_session("specblock-chain", target, drafter)
    g = generate(target, session, BUILDERS["specblock-chain"], prompts[0], 24, 8)
    assert g.tokens == plain
    # Every step drafts 8 deep (two blocks of 4) but the last ones, cut to the tokens still wanted.
    assert max(s.tree_size for s in g.steps) == 8
    assert [s.forwards for s in g.steps] == [max(1, -(-s.tree_size // drafter.block_size)) for s in g.steps]
