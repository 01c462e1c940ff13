"""A run killed with SIGKILL resumes with --ckpt_path last and follows the uninterrupted loss curve."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import ROOT, make_drafter_dirs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS = 24


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = make_drafter_dirs(tmp_path_factory.mktemp("resume"), n_modules=20)
    r = yaml.safe_load((ROOT / "recipes" / "treeflash_tiny.yaml").read_text())
    r["trainer"].update(
        max_steps=STEPS, log_every_n_steps=1, val_check_interval=STEPS, limit_val_batches=1, enable_progress_bar=False
    )
    r["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 3
    r["model"]["init_args"].update(target=str(root / "target"), backbone=str(root / "dflash"), max_anchors=8)
    r["data"]["init_args"]["spec"].update(
        paths=[str(root / "text")], tokenizer=str(root / "target"), max_length=128, validation_fraction=0.1
    )
    r["data"]["init_args"]["batch_size"] = 2
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def fit(recipe, run_dir, *extra):
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "fit",
        "--recipe",
        str(recipe),
        "--trainer.default_root_dir",
        str(run_dir),
        "--model.export_dir",
        str(run_dir / "hf"),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def losses(run_dir) -> dict[int, float]:
    out = {}
    for events in sorted(run_dir.glob("lightning_logs/version_*/events.*")):
        ea = EventAccumulator(str(events))
        ea.Reload()
        if "train/kl" in ea.Tags()["scalars"]:
            out.update({e.step: e.value for e in ea.Scalars("train/kl")})
    return out


@pytest.mark.slow
def test_sigkill_then_resume_follows_the_same_curve(recipe, tmp_path):
    straight = fit(recipe, tmp_path / "straight")
    killed = fit(recipe, tmp_path / "killed")
    ckpt = tmp_path / "killed" / "lightning_logs" / "version_0" / "checkpoints"
    deadline = time.time() + 300
    while not list(ckpt.glob("epoch=*-step=*.ckpt")) and time.time() < deadline and killed.poll() is None:
        time.sleep(0.02)
    assert killed.poll() is None, "the run finished before it could be killed"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    newest = max(ckpt.glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    resumed_from = torch.load(newest, map_location="cpu", weights_only=False)["global_step"]
    # Killed early in the epoch: the resumed run must take the rest of that epoch in the same order.
    assert 0 < resumed_from < STEPS - 9
    assert straight.wait(timeout=600) == 0, straight.communicate()[1][-2000:]
    resumed = fit(recipe, tmp_path / "killed", "--ckpt_path", "last")
    assert resumed.wait(timeout=600) == 0, resumed.communicate()[1][-2000:]
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert max(a) == STEPS - 1, sorted(a)
    assert max(b) == STEPS - 1, sorted(b)
    for step in range(resumed_from, STEPS):
        assert abs(a[step] - b[step]) < 1e-4 * max(1.0, abs(a[step])), (step, a[step], b[step])
