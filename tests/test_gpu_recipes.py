"""Every shipped GPU recipe takes its first optimizer steps on the CPU, at a shrunk shape, the way it is set up:
its own strategy on 2 processes (gloo), its precision, its callbacks (``GradientCheckpointing`` included) and its
data path, so a recipe that cannot start fails here rather than on a GPU node.

One ``benchmarks/scale.py --shrink --devices 2`` run trains them all (the GPU recipes, read from ``recipes/``:
those whose ``trainer.accelerator`` is ``gpu``), 2 optimizer steps each, then one validation batch and the export
``trainer fit`` ends with. scale.py builds random targets of each recipe's architecture at width 64 with its real
vocabulary (and TreeFlash's random DFlash backbone), and keeps everything of the recipe but what a CPU cannot hold
or reach: the targets are the shrunk ones, the data is a few stdlib modules as text rows of 128 tokens (the
recipes' regenerated chat files are not shipped; the tokenizer is the target directory's), max_anchors is 8.

- Strategy: DDP and FSDP2 (``trainer.strategies.FSDP2Strategy``) run as the recipes state them, on 2 CPU
  processes over gloo. DeepSpeed ZeRO (``trainer.strategies.ZeroStrategy``, ``specblock_llama31_8b``) needs CUDA
  under Lightning, so it is **substituted**: ZeRO-2 runs as **DDP** (ZeRO-1/2 keep every parameter on every rank
  and run DDP's forward and backward, sharding only gradients and optimizer state); ZeRO-3 would run as FSDP2
  (``scale.cpu_strategy``). The ZeRO config itself is checked by DeepSpeed's parser in tests/test_distributed.py.
- Precision: the recipes' own, ``bf16-true`` (bfloat16 weights) and ``bf16-mixed`` (float32 weights, bfloat16
  autocast), both of which the CPU runs.
- Callbacks: the recipe's (ModelCheckpoint, GradientCheckpointing) plus scale.py's StepClock, which records what
  the trainer ran: strategy, world size, precision, callbacks, checkpointed drafter layers, optimizer steps.
- Data path: online target features, and for ``dflash_qwen3_8b_offline`` a feature cache built first by
  ``trainer data cache`` from the same data spec, with the drafter's target layers, top-k and target dtype; that
  run's steps run no target forward.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, copy_stdlib

pytestmark = pytest.mark.slow

STEPS = 2
DEVICES = 2


def gpu_recipes() -> dict[str, dict]:
    """The shipped recipes that run on GPUs, by name."""
    recipes = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "recipes").glob("*.yaml"))}
    return {name: r for name, r in recipes.items() if r["trainer"].get("accelerator") == "gpu"}


RECIPES = gpu_recipes()
# What each recipe strategy runs as on the CPU (DeepSpeed ZeRO substituted, see the module docstring).
RUNS_AS = {
    "ddp": "DDPStrategy",
    "trainer.strategies.FSDP2Strategy": "FSDP2Strategy",
    "trainer.strategies.ZeroStrategy-1": "DDPStrategy",
    "trainer.strategies.ZeroStrategy-2": "DDPStrategy",
    "trainer.strategies.ZeroStrategy-3": "FSDP2Strategy",
}


def strategy_key(recipe: dict) -> str:
    """The recipe's strategy: its name or class path, with the stage of a DeepSpeed ZeRO one."""
    strategy = recipe["trainer"]["strategy"]
    if not isinstance(strategy, dict):
        return strategy
    if strategy["class_path"] == "trainer.strategies.ZeroStrategy":
        return f"{strategy['class_path']}-{(strategy.get('init_args') or {}).get('stage', 2)}"
    return strategy["class_path"]


def test_every_gpu_recipe_is_run():
    assert set(RECIPES) >= {
        "dflash_qwen3_4b",
        "dflash_qwen3_8b_offline",
        "treeflash_qwen3_4b",
        "treeflash_qwen3_8b",
        "eagle3_qwen3_8b",
        "eagle3_llama31_8b",
        "specblock_qwen3_8b",
        "specblock_llama31_8b",
    }
    # A strategy this test does not know how to check is a new case to add here, not a silent pass.
    assert {strategy_key(r) for r in RECIPES.values()} <= set(RUNS_AS)


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    """scale.py over every GPU recipe in one process; its stdout and its work directory."""
    root = tmp_path_factory.mktemp("gpu_recipes")
    data = copy_stdlib(root / "text", 8)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "MASTER_"))}
    env = {**inherited, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    command = [
        sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--shrink", "--devices", str(DEVICES),
        "--recipes", ",".join(RECIPES), "--steps", str(STEPS), "--warmup", "1", "--val-batches", "1", "--no-flops",
        "--data", str(data), "--work", str(root / "work"), "--timeout", "300",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    return proc, root / "work"


@pytest.mark.parametrize("name", list(RECIPES))
def test_gpu_recipe_takes_its_first_steps_as_set_up(scale_run, name):
    proc, work = scale_run
    recipe = RECIPES[name]
    context = f"scale.py:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    # scale.py's final table: the recipe's line has its figures, and no "then failed" line follows it.
    lines = proc.stdout.split("largest phase")[-1].splitlines()
    row = next((i for i, line in enumerate(lines) if line.startswith(f"{name} ")), None)
    assert row is not None, f"{name} is not in scale.py's table: {context}"
    assert re.match(rf"{name} +\d", lines[row]), f"{name} did not train: {lines[row]}\n{context}"
    assert "then failed" not in "".join(lines[row + 1 : row + 2]), f"{name} failed after its steps: {context}"
    report = json.loads((work / "runs" / name / "report.json").read_text())
    run = report["run"]
    # The first optimizer steps ran, to finite losses, then the fit ended with its export.
    assert report["optimizer_steps"] == STEPS and len(report["losses"]) == STEPS
    assert all(math.isfinite(loss) for loss in report["losses"])
    assert list((work / "runs" / name).glob("lightning_logs/version_*/hf/config.json")), context
    # Its strategy on 2 processes, its precision.
    assert (run["strategy"], run["world_size"]) == (RUNS_AS[strategy_key(recipe)], DEVICES)
    precision = recipe["trainer"]["precision"]
    assert run["precision"] == precision
    assert run["trainable_dtype"] == {"bf16-true": "bfloat16", "bf16-mixed": "float32"}[precision]
    # Its callbacks; gradient checkpointing is on in every drafter layer of a recipe that asks for it.
    listed = [c["class_path"].rpartition(".")[2] for c in recipe["trainer"].get("callbacks", [])]
    assert set(listed) <= set(run["callbacks"])
    drafter_layers = recipe["model"]["init_args"].get("num_layers")
    if "GradientCheckpointing" in listed:
        assert run["checkpointed_layers"] == drafter_layers > 0
    else:
        assert run["checkpointed_layers"] == 0
    # Its data path: an offline recipe's steps run no target forward; an online recipe's do.
    offline = recipe["data"]["init_args"].get("features") == "offline"
    assert (report["phases_s"]["target forward"] == 0) == offline
    if offline:
        assert (work / "caches" / name / "manifest.json").is_file()
