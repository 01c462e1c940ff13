"""Tree options: parsed from `--tree-opt KEY=VALUE`, bad ones named, and honoured by the builders."""

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.decoding.options import TreeOptions
from trainer.drafters.eagle3 import Eagle3DraftModel
from trainer.drafters.eagle3 import build_config as eagle3_config
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError


def test_parse_converts_each_kind():
    options = TreeOptions.parse(
        ["eagle_top_k=8", "specblock-branch=2,4,6,4", "recycling_decay=0.3", "treeflash_top_m=none"]
    )
    assert options.eagle_top_k == 8
    assert options.specblock_branch == (2, 4, 6, 4)
    assert options.recycling_decay == 0.3
    assert options.treeflash_top_m is None
    assert TreeOptions.parse([]) == TreeOptions()
    graft = TreeOptions.parse(
        ["graft_checkpoints=0,2", "graft_thresholds=0.3,0.25", "graft_draft_share=0.5,1,1", "graft_retrieval=false"]
    )
    assert graft.graft_checkpoints == (0, 2) and graft.graft_thresholds == (0.3, 0.25)
    assert graft.graft_draft_share == (0.5, 1.0, 1.0) and graft.graft_retrieval is False
    assert TreeOptions.parse(["graft_retrieval=yes"]).graft_retrieval is True
    growth = TreeOptions.parse(["specblock_launch_greedy=false", "specblock_root_width=none", "specblock_stop=chain"])
    assert growth.specblock_launch_greedy is False and growth.specblock_root_width is None
    assert growth.specblock_stop == "chain"


@pytest.mark.parametrize(
    "item,words",
    [
        ("eagle_topk=8", "KEY one of"),
        ("eagle_top_k", "KEY=VALUE"),
        ("eagle_top_k=eight", "not a valid int"),
        ("eagle_depth=0", "at least 1"),
        ("specblock_branch=1,2", "4 widths"),
        ("recycling_decay=1.5", "(0, 1)"),
        ("graft_checkpoints=1,0,5", "ascending"),
        ("graft_thresholds=0.1", "one threshold per checkpoint"),
        ("graft_draft_share=0.5,0.5,1.5,1", "shares in [0, 1]"),
        ("graft_confidence=entropy", "one of"),
        ("graft_retrieval=maybe", "not a valid bool"),
        ("specblock_launch_greedy=maybe", "not a valid bool"),
        ("specblock_stop=tree", "branching"),
        ("specblock_root_width=0", "at least 1 or none"),
    ],
)
def test_bad_option_is_named(item, words):
    with pytest.raises(UserError, match="tree option") as info:
        TreeOptions.parse([item])
    assert words in str(info.value)


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()


def test_treeflash_width_defaults_to_the_checkpoint(target):
    drafter = TreeFlashDraftModel.from_dflash(str(ROOT / "checkpoints" / "dflash_tiny")).eval()
    drafter.config.treeflash_config["candidate_tokens"] = 3
    prompt = torch.tensor([5, 6, 7, 8])
    outputs, widths = [], []
    for options in (TreeOptions(), TreeOptions(treeflash_top_m=16)):
        session = make_session("treeflash", target, drafter, options)
        transitions = session.transitions

        def recording(root, depth, top_m, top_k, _inner=transitions):
            widths.append(top_m)
            tables = _inner(root, depth, top_m, top_k)
            # Shape: (depth, M, K) continuations of every slot's M candidates.
            assert tables.tokens.shape[1:] == (top_m, top_k)
            return tables

        session.transitions = recording
        outputs.append(generate(target, session, BUILDERS["treeflash"], prompt, 4, budget=32, options=options).tokens)
    assert set(widths) == {3, 16}
    assert outputs[0] == outputs[1]  # greedy output is the target's whatever the tree


def test_eagle_depth_sets_drafter_forwards(target):
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(eagle3_config(target.config, draft_vocab_size=target.config.vocab_size)).eval()
    for depth in (2, 4):
        options = TreeOptions(eagle_depth=depth)
        session = make_session("eagle", target, drafter, options)
        g = generate(target, session, BUILDERS["eagle"], torch.tensor([5, 6, 7]), 8, budget=32, options=options)
        # One drafter forward per depth: the context's, then one per expanded depth.
        assert g.steps[0].forwards == depth
        assert max(s.tree_depth for s in g.steps) <= depth


def test_graft_checkpoints_cut_drafter_forwards(target):
    """EAGLE-3 under Graft: a threshold no frontier reaches stops at the first checkpoint (the context forward
    only); zero thresholds never prune (EAGLE's full depth); near the end, checkpoints past the depth never fire."""
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(eagle3_config(target.config, draft_vocab_size=target.config.vocab_size)).eval()
    prompt = torch.tensor([5, 6, 7, 5, 6, 7])
    cases = [((0, 1, 5), (1.1, 1.1, 1.1), 1, 0), ((1, 3), (0.0, 1.1), 4, 1), ((0, 1, 5), (0.0, 0.0, 0.0), 7, 3)]
    for checkpoints, thresholds, forwards, stage in cases:
        share = (0.5,) * (len(checkpoints) + 1)
        options = TreeOptions(graft_checkpoints=checkpoints, graft_thresholds=thresholds, graft_draft_share=share)
        session = make_session("graft", target, drafter, options)
        g = generate(target, session, BUILDERS["graft"], prompt, 9, budget=16, options=options)
        assert g.steps[0].forwards == forwards
        assert stage in session.stages
