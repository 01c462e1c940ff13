"""Scale-out on CPU (gloo): DDP and FSDP2 on 2 processes take the same steps as one process with 2-step gradient
accumulation (losses and weights), an FSDP2 run resumes from its sharded checkpoint on another number of ranks
and ``trainer export`` reads that checkpoint, and the DeepSpeed configs pass DeepSpeed's own validation. (The
directory swap behind sharded checkpoints is tested with ``trainer.io`` in tests/test_io.py.)

Each multi-process run is ``tests/dist_fit.py`` launched the way ``trainer fit`` is (Lightning starts rank 1 by
running the script again); DeepSpeed itself needs CUDA, so only its configuration is checked here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT, make_target_dirs

from trainer.export.source import load_source
from trainer.io import partial_path

pytestmark = pytest.mark.slow

STEPS = 4
RANK_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The data and target, and the single-process reference: batch 1, 2-step accumulation. The reference runs
    in a fresh process like the distributed runs, with the same environment."""
    root = tmp_path_factory.mktemp("dist")
    make_target_dirs(root, n_modules=6)
    launch(root, "single", "--accumulate", "2", "--steps", str(STEPS))
    return root


def launch(root, name: str, *args: str) -> None:
    # Lightning passes its seed and rendezvous to the ranks through PL_* / MASTER_* variables; ones left in the
    # pytest process by earlier Lightning runs (PL_GLOBAL_SEED) would reseed the ranks.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "MASTER_")) and k not in RANK_VARS}
    env = {**inherited, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "tests" / "dist_fit.py"), str(root), str(root / name), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def losses(run) -> list[list[float]]:
    return [json.loads(p.read_text()) for p in sorted(run.glob("losses_rank*.json"))]


def assert_same_weights(a, b) -> None:
    ours, theirs = torch.load(a / "drafter.pt"), torch.load(b / "drafter.pt")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)


def assert_matches_single(root, name: str) -> None:
    (single,) = losses(root / "single")
    rank0, rank1 = losses(root / name)
    # Step k: rank r took what the single process took in micro-batch r of step k.
    torch.testing.assert_close(rank0, single[0::2], rtol=0, atol=1e-5)
    torch.testing.assert_close(rank1, single[1::2], rtol=0, atol=1e-5)
    assert_same_weights(root / name, root / "single")


def test_ddp_on_two_processes_matches_one_process(runs):
    launch(runs, "ddp", "--strategy", "ddp", "--devices", "2", "--steps", str(STEPS))
    assert_matches_single(runs, "ddp")


def test_fsdp2_matches_one_process_and_resumes_on_one_rank(runs):
    # With gradient checkpointing too: recomputing the sharded layers in the backward changes nothing.
    launch(
        runs,
        "fsdp2",
        "--strategy",
        "fsdp2",
        "--devices",
        "2",
        "--steps",
        str(STEPS),
        "--save-every",
        "2",
        "--checkpointing",
    )
    assert_matches_single(runs, "fsdp2")
    checkpoint = runs / "fsdp2" / "checkpoints" / "epoch=0-step=2.ckpt"
    assert (checkpoint / "meta.pt").is_file() and not partial_path(checkpoint).exists()
    # trainer export reads the sharded directory in one process: the step-4 shards are the final weights.
    final = load_source(runs / "fsdp2" / "checkpoints" / "last.ckpt").drafter.state_dict()
    for name, value in torch.load(runs / "fsdp2" / "drafter.pt").items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0, msg=name)
    # The rest of the run from the step-2 shards, on one rank: same order, same steps, same weights.
    launch(
        runs,
        "resumed",
        "--strategy",
        "fsdp2",
        "--accumulate",
        "2",
        "--steps",
        str(STEPS),
        "--ckpt-path",
        str(checkpoint),
    )
    (resumed,) = losses(runs / "resumed")
    (single,) = losses(runs / "single")
    torch.testing.assert_close(resumed, single[4:], rtol=0, atol=1e-5)
    assert_same_weights(runs / "resumed", runs / "single")


def zero_recipes() -> list[str]:
    """The recipes whose trainer.strategy is DeepSpeed ZeRO."""
    out = []
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        strategy = yaml.safe_load(path.read_text())["trainer"].get("strategy")
        if isinstance(strategy, dict) and strategy["class_path"] == "trainer.strategies.ZeroStrategy":
            out.append(path.stem)
    return out


def test_a_deepspeed_recipe_is_shipped():
    assert zero_recipes()


@pytest.mark.parametrize("recipe", zero_recipes())
def test_deepspeed_recipes_pass_deepspeed_validation(recipe):
    strategy = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["trainer"]["strategy"]
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional extra: pip install -e '.[deepspeed]'")
    from deepspeed.runtime.config import DeepSpeedConfig

    from trainer.strategies import ZeroStrategy

    config = dict(ZeroStrategy(**strategy.get("init_args", {})).config)
    # What Lightning fills in from the recipe's trainer and data before it starts DeepSpeed.
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    checked = DeepSpeedConfig(config)
    assert checked.zero_optimization_stage == strategy["init_args"]["stage"]
    with pytest.raises(Exception, match="bogus"):
        DeepSpeedConfig({**config, "zero_optimization": {**config["zero_optimization"], "bogus": 1}})
