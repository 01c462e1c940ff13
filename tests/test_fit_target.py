import os
import subprocess
import sys

import torch
import yaml
from conftest import ROOT
from transformers import AutoModelForCausalLM

from trainer.tiny.pretrain import StdlibCorpus
from trainer.tiny.report import heldout_loss


def trainer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def test_twenty_step_fit_writes_checkpoint_config_and_hf_export(tmp_path):
    run = tmp_path / "run"
    slice_args = [
        "--recipe",
        "target_tiny",
        "--data.max_files",
        "30",
        "--data.seq_len",
        "128",
        "--data.batch_size",
        "4",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--trainer.limit_val_batches",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(run),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        trainer_cmd("fit", *slice_args, "--trainer.max_steps", "20", "--model.export_dir", str(tmp_path / "hf")),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = run / "lightning_logs" / "version_0"
    ckpts = sorted((version / "checkpoints").glob("*.ckpt"))
    assert ckpts, f"no checkpoint in {version}"
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
    assert state["global_step"] == 20
    # The resolved recipe sits beside the checkpoint, overrides applied.
    saved = yaml.safe_load((version / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 20 and saved["data"]["init_args"]["max_files"] == 30

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 8 and model.config.vocab_size == 8192
    assert not (tmp_path / "hf.partial").exists()
    data = StdlibCorpus(max_files=30, cache_dir=str(tmp_path / "cache"))
    data.setup()
    # 20 steps from a random init (log V = 9.01 nats) must already have learned the token frequencies.
    assert heldout_loss(model, data.tokens("validation")[:4097], seq_len=128) < 8.0

    proc = subprocess.run(
        trainer_cmd("validate", *slice_args, "--ckpt_path", str(ckpts[-1])),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val/loss" in proc.stdout


def test_continue_from_the_shipped_target(tmp_path):
    from conftest import TINY_TARGET

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        trainer_cmd(
            "fit",
            "--recipe",
            "target_tiny",
            "--model.init_from",
            str(TINY_TARGET),
            "--data.max_files",
            "30",
            "--data.seq_len",
            "128",
            "--data.batch_size",
            "4",
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--trainer.limit_val_batches",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.max_steps",
            "2",
            "--model.export_dir",
            str(tmp_path / "hf"),
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    data = StdlibCorpus(max_files=30, cache_dir=str(tmp_path / "cache"))
    data.setup()
    # Two small steps from the shipped weights keep its quality (a random init sits at 9 nats).
    assert heldout_loss(model, data.tokens("validation")[:4097], seq_len=128) < 5.0
