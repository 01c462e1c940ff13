"""The drafter family registry (trainer/drafters/families.py) and every per-family table keyed by it.

PYTHONPATH=$PWD python -m pytest tests/test_families.py -q
"""

import pytest
import torch
from conftest import TINY_TARGET
from transformers import AutoModelForCausalLM

from trainer.adapt.bandit_daemon import UPDATE_OPTIONS
from trainer.decoding.builders import BUILDERS, NATIVE_TREES, SESSIONS, make_session, native_tree
from trainer.drafters import DRAFTER_CLASSES, load_drafter
from trainer.drafters.families import FAMILIES, family_of
from trainer.export import FORMATS
from trainer.training.step import STEPS, default_options

SHIPPED = {"dflash": "checkpoints/dflash_tiny", "treeflash": "checkpoints/treeflash_tiny",
           "eagle3": "checkpoints/eagle3_tiny", "specblock": "checkpoints/specblock_tiny"}  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()


def test_every_per_family_table_names_every_family():
    for table in (SESSIONS, NATIVE_TREES, STEPS, UPDATE_OPTIONS):
        assert table.keys() == FAMILIES.keys()
    assert set(DRAFTER_CLASSES.values()) == {f.cls for f in FAMILIES.values()}
    accepted = {name for module in FORMATS.values() for name in module.ACCEPTS}
    assert accepted == set(FAMILIES), "every family exports somewhere, and formats name families only"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_drafter_is_its_family_and_its_tables_agree(name, target):
    drafter = load_drafter(SHIPPED[name])
    family = family_of(drafter)
    assert family.name == name and family_of(type(drafter)) is family
    assert isinstance(default_options(drafter), STEPS[name].options)
    assert isinstance(UPDATE_OPTIONS[name], STEPS[name].options)
    # The family's own builder drafts with this drafter's session, not a plain or retrieval one.
    tree = native_tree(drafter)
    assert BUILDERS[tree].session is SESSIONS[name]
    assert type(make_session(tree, target, drafter)) is SESSIONS[name]
    core = family.core(drafter)
    assert hasattr(core, "target_layer_ids")
    full = family.parameters(drafter, "full")
    assert sum(p.numel() for p in full) == sum(p.numel() for p in drafter.parameters())
    if family.approximator is None:
        with pytest.raises(ValueError, match="no trainable part 'approx'"):
            family.parameters(drafter, "approx")
    else:
        approx = family.parameters(drafter, "approx")
        assert 0 < sum(p.numel() for p in approx) < sum(p.numel() for p in full)


def test_with_core_puts_a_replaced_core_where_the_drafter_reads_it():
    tree = load_drafter(SHIPPED["treeflash"])
    family = family_of(tree)
    copy = type(family.core(tree))(family.core(tree).config)
    assert family.with_core(tree, copy) is tree and tree.model is copy
    dflash = load_drafter(SHIPPED["dflash"])
    other = type(dflash)(dflash.config)
    assert family_of(dflash).with_core(dflash, other) is other


def test_anything_else_is_no_family():
    with pytest.raises(TypeError, match="Linear is no drafter of a known family"):
        family_of(torch.nn.Linear(2, 2))
