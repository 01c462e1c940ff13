"""Every script in benchmarks/ runs end to end in its smoke mode (``--smoke``: seconds, tiny sizes), each in its own
process as a user runs it, so a change that breaks a benchmark fails here instead of when someone next measures.
``benchmarks/scale.py --smoke`` trains two recipes at a shrunk shape on the CPU and its report is checked."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT
from transformers import AutoModelForCausalLM

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def run_smoke(script: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    command = [sys.executable, str(BENCHMARKS / script), "--smoke", *extra]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


# scale.py has its own tests below; vllm_plugin.py, data_engines.py and vllm_methods.py need vLLM's environment
# (tests/test_vllm.py, tests/test_vllm_data.py and tests/test_vllm_graft.py run their smoke modes); closed_loop.py is
# run by tests/test_closed_loop.py.
SELF_TESTED = ("scale.py", "vllm_plugin.py", "data_engines.py", "vllm_methods.py", "closed_loop.py")


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in SELF_TESTED])
def test_benchmark_runs_in_smoke_mode(script):
    proc = run_smoke(script)
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def load_scale():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import scale
    finally:
        sys.path.remove(str(BENCHMARKS))
    return scale


@pytest.mark.slow
def test_scale_runs_recipes_at_a_shrunk_shape(tmp_path):
    # A recipe that cannot run comes first: it is reported, the others still run, and the exit status says so.
    # dflash_qwen3_4b clips the gradients of sharded and replicated trainable parameters together (FSDP2).
    recipes = "nosuch_qwen3_4b,treeflash_qwen3_4b,eagle3_llama31_8b,dflash_qwen3_4b"
    proc = run_smoke("scale.py", "--work", str(tmp_path), "--recipes", recipes)
    assert proc.returncode == 1, f"scale.py --smoke:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    table = proc.stdout.split("largest phase")[-1]
    assert "nosuch_qwen3_4b        failed: RecipeError: recipe 'nosuch_qwen3_4b' not found" in table
    for recipe in ("treeflash_qwen3_4b", "eagle3_llama31_8b", "dflash_qwen3_4b"):
        report = json.loads((tmp_path / "runs" / recipe / "report.json").read_text())
        assert report["timed_steps"] == 2 and report["s_per_step"] > 0
        assert report["tokens_per_step"] == 128
        assert f"{recipe:<22} {report['s_per_step']:>7.3f}" in table
        flops = report["flops_by_phase"]
        # The target's forward is its linear layers and logits over the row, 2·T·(P_linear + d·V), plus at most
        # its attention computed dense, 4·L·T²·H·d_h (a CPU's attention kernel may go uncounted).
        c = json.loads((tmp_path / "targets" / f"{recipe.split('_', 1)[1]}_shrink" / "config.json").read_text())
        d, heads, kv, d_h, T = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], 128
        linear = c["num_hidden_layers"] * (2 * d * heads * d_h + 2 * d * kv * d_h + 3 * d * c["intermediate_size"])
        lowest = 2 * T * (linear + d * c["vocab_size"])
        assert lowest <= flops["target forward"] <= lowest + 4 * c["num_hidden_layers"] * T * T * heads * d_h
        assert flops["backward"] > 0 and flops["drafter forward and loss"] > 0
        assert report["flops_per_step"] == pytest.approx(sum(flops.values()))
        assert report["mfu"] is None  # no known peak on a CPU
    # TreeFlash calls the target's LM head on the drafter's states; EAGLE-3 has its own head.
    treeflash = json.loads((tmp_path / "runs" / "treeflash_qwen3_4b" / "report.json").read_text())
    assert treeflash["flops_by_phase"]["LM head"] > 0
    assert (tmp_path / "backbones" / "dflash_qwen3_4b_shrink" / "config.json").is_file()


def test_scale_shape_of_a_recipe():
    scale = load_scale()
    assert scale.shape_of("eagle3_llama31_8b") == "llama31_8b"
    with pytest.raises(ValueError, match="names none of the shapes"):
        scale.shape_of("dflash_tiny")


@pytest.mark.parametrize(
    ("shape", "parameters"),
    # The published parameter counts of Qwen3-4B, Qwen3-8B and Llama-3.1-8B.
    [("qwen3_4b", 4_022_468_096), ("qwen3_8b", 8_190_735_360), ("llama31_8b", 8_030_261_248)],
)
def test_scale_shapes_are_the_real_models(shape, parameters):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_scale().model_config(shape, shrink=False))
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_scale_fit_command_passes_attention_and_overrides(tmp_path):
    scale = load_scale()
    parser_args = dict(
        steps=7, warmup=2, val_batches=1, data="stdlib:train", max_length=0, shrink=False, peak_tflops=None,
        flops=True, attention="dense", override=["model.max_anchors=256", "--trainer.log_every_n_steps=1"],
    )  # fmt: skip
    args = argparse.Namespace(**parser_args)
    command = scale.fit_command("dflash_qwen3_4b", args, tmp_path, tmp_path / "target", None)
    options = dict(zip(command[6::2], command[7::2], strict=True))
    assert command[1:6] == ["-m", "trainer", "fit", "--recipe", str(tmp_path / "recipe.yaml")]
    assert options["--model.attention"] == "dense"
    assert options["--model.max_anchors"] == "256" and options["--trainer.log_every_n_steps"] == "1"
    assert options["--trainer.max_steps"] == "7" and "--data.spec.max_length" not in options
    # The copy of the recipe keeps its callbacks and adds the clock.
    callbacks = yaml.safe_load((tmp_path / "recipe.yaml").read_text())["trainer"]["callbacks"]
    assert [c["class_path"] for c in callbacks][-2:] == ["trainer.callbacks.GradientCheckpointing", "scale.StepClock"]
    assert callbacks[-1]["init_args"]["warmup"] == 2
