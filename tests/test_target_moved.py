"""The moved target's data: an installed package's own source as the corpus (recipes/target_tiny_moved.yaml)."""

import importlib.metadata
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM

from trainer.errors import UserError
from trainer.tiny.corpus import SPLITS, list_modules, package_root, read_module, split_of
from trainer.tiny.pretrain import StdlibCorpus
from trainer.tiny.report import heldout_loss


def test_a_package_splits_by_the_hash_of_its_dotted_module_names():
    root = package_root("torch")
    by_split = {s: list_modules(s, root, "torch") for s in SPLITS}
    names = {s: {m.name for m in mods} for s, mods in by_split.items()}
    assert all(names.values())
    assert not names["train"] & names["validation"] and not names["train"] & names["heldout"]
    assert all(split_of(n) == s for s, ns in names.items() for n in ns)
    # Dotted from the package's name: the package's own __init__ is "torch", a submodule "torch.nn.functional".
    every = set().union(*names.values())
    assert {"torch", "torch.nn.functional"} <= every
    assert all(m.path.is_relative_to(root) for mods in by_split.values() for m in mods)


def test_the_package_corpus_is_its_modules_each_ended_by_eos_and_cached_apart_from_the_stdlib(tmp_path):
    corpus = StdlibCorpus(packages=["torch"], max_files=3, cache_dir=str(tmp_path))
    tokens = corpus.tokens("heldout")
    modules = list_modules("heldout", package_root("torch"), "torch")[:3]
    texts = [t for t in map(read_module, modules) if t]
    eos = corpus.tokenizer.eos_token_id
    assert int(np.sum(tokens == eos)) >= len(texts) and tokens[-1] == eos
    first = corpus.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert tokens[: len(first)].tolist() == first
    stdlib = StdlibCorpus(max_files=3, cache_dir=str(tmp_path)).tokens("heldout")
    cached = sorted(p.name for p in tmp_path.glob("*.npy"))
    assert len(cached) == 2 and any(n.startswith(f"torch{importlib.metadata.version('torch')}-") for n in cached)
    assert stdlib[: len(first)].tolist() != first


@pytest.mark.parametrize("packages", [["no_such_package_here"], []])
def test_a_package_that_is_not_installed_or_none_is_refused_at_construction(packages, tmp_path):
    with pytest.raises(UserError, match="package"):
        StdlibCorpus(packages=packages, cache_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_moved_recipe_fine_tunes_the_shipped_target_on_a_package_slice(tmp_path):
    hf, cache = tmp_path / "hf", tmp_path / "cache"
    args = [
        "--recipe", "target_tiny_moved", "--trainer.max_steps", "2", "--model.warmup_steps", "1",
        "--data.max_files", "20", "--data.seq_len", "128", "--data.batch_size", "4", "--data.cache_dir", str(cache),
        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"), "--model.export_dir", str(hf),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "trainer", "fit", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(p.name.startswith("torch") for p in cache.glob("*.npy")), "the fine-tune did not read torch's source"
    shipped = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    moved = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    weights = shipped.state_dict()
    assert any(not torch.equal(weights[k], v) for k, v in moved.state_dict().items()), "no weight moved"
    # From the shipped weights, not a random init (9 nats): two steps keep its quality on the package's slice.
    held = np.asarray(StdlibCorpus(packages=["torch"], max_files=20, cache_dir=str(cache)).tokens("validation"))
    assert heldout_loss(moved, held[:4097], seq_len=128) < 5.0
