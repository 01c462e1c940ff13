import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM

from trainer.tiny.pretrain import StdlibCorpus
from trainer.tiny.report import heldout_loss


def trainer_on_slice(command: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """``trainer COMMAND --recipe target_tiny`` on a 30-module slice, rows of 128, run dir and cache in tmp."""
    args = [
        "--recipe", "target_tiny",
        "--data.max_files", "30", "--data.seq_len", "128", "--data.batch_size", "4",
        "--data.cache_dir", str(tmp_path / "cache"),
        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", command, *args, *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def slice_validation_loss(model_dir: Path, tmp_path: Path) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = StdlibCorpus(max_files=30, cache_dir=str(tmp_path / "cache"))
    data.setup()
    return heldout_loss(model, data.tokens("validation")[:4097], seq_len=128)


@pytest.mark.slow
def test_twenty_step_fit_writes_checkpoint_config_and_hf_export(tmp_path):
    trainer_on_slice("fit", tmp_path, "--trainer.max_steps", "20", "--model.export_dir", str(tmp_path / "hf"))
    version = tmp_path / "run" / "lightning_logs" / "version_0"
    ckpts = sorted((version / "checkpoints").glob("*.ckpt"))
    assert ckpts, f"no checkpoint in {version}"
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
    assert state["global_step"] == 20
    # The resolved recipe sits beside the checkpoint, overrides applied.
    saved = yaml.safe_load((version / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 20 and saved["data"]["init_args"]["max_files"] == 30

    config = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config
    assert config.num_hidden_layers == 8 and config.vocab_size == 8192
    assert not (tmp_path / "hf.partial").exists()
    # 20 steps from a random init (log V = 9.01 nats) must already have learned the token frequencies.
    assert slice_validation_loss(tmp_path / "hf", tmp_path) < 8.0

    proc = trainer_on_slice("validate", tmp_path, "--ckpt_path", str(ckpts[-1]))
    assert "val/loss" in proc.stdout


@pytest.mark.slow
def test_continue_from_the_shipped_target(tmp_path):
    trainer_on_slice(
        "fit", tmp_path, "--model.init_from", str(TINY_TARGET), "--trainer.max_steps", "2",
        "--model.export_dir", str(tmp_path / "hf"),
    )  # fmt: skip
    # Two small steps from the shipped weights keep its quality (a random init sits at 9 nats).
    assert slice_validation_loss(tmp_path / "hf", tmp_path) < 5.0
