import json

from conftest import ROOT

from trainer.tiny.corpus import SPLITS, list_modules, split_of, stdlib_root


def test_splits_are_disjoint_cover_stdlib_and_exclude_third_party():
    by_split = {s: {m.name for m in list_modules(s)} for s in SPLITS}
    assert not by_split["train"] & by_split["validation"]
    assert not by_split["train"] & by_split["heldout"]
    assert not by_split["validation"] & by_split["heldout"]
    all_names = set().union(*by_split.values())
    assert "json.decoder" in all_names and "collections" in all_names
    assert not any(n.startswith(("site-packages", "dist-packages")) for n in all_names)
    for split, names in by_split.items():
        assert names, split
        assert all(split_of(n) == split for n in names)
    assert len(by_split["train"]) > 10 * len(by_split["heldout"])


def test_modules_come_from_the_running_stdlib():
    root = stdlib_root()
    for module in list_modules("heldout")[:20]:
        assert module.path.is_relative_to(root)
        assert module.path.suffix == ".py"


def test_shipped_heldout_manifest_matches_the_split_rule():
    manifest = json.loads((ROOT / "data" / "stdlib_heldout_modules.json").read_text())
    assert manifest["modules"], "held-out manifest is empty"
    assert all(split_of(name) == "heldout" for name in manifest["modules"])
    here = {m.name for m in list_modules("heldout")}
    # The shipped list was made on Python 3.11; modules of this interpreter's stdlib must agree with it.
    assert len(here & set(manifest["modules"])) >= 0.8 * len(manifest["modules"])
