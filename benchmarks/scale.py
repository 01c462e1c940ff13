"""Training at the real shapes: a recipe's ``trainer fit`` for a few steps on random weights, timed and counted.

For each recipe (``recipes/*.yaml`` of a real target: ``treeflash_qwen3_4b``, ``dflash_qwen3_4b``,
``specblock_qwen3_8b``, ``eagle3_llama31_8b``, ...) the script builds a randomly initialised target of the recipe's
shape (Qwen3-4B, Qwen3-8B or Llama-3.1-8B, configs written below, no hub) with the shipped tiny tokenizer (its ids
are a subset of every vocabulary here), and for TreeFlash a random DFlash backbone of ``--backbone-layers`` layers
from :func:`trainer.drafters.dflash.build_config`; the other families' drafters are built by their recipes as in
any new run. Both are saved as HF directories under ``--work`` (built on the GPU in bfloat16; reused when present).
Then ``trainer fit --recipe R`` runs in a subprocess on the first device it finds, with the command line the issue
measured (``--model.target DIR --trainer.devices 1 --data.spec.paths '[stdlib:train]' --data.spec.format text``)
plus ``--trainer.max_steps``, and the :class:`StepClock` callback prints, as it goes:

- seconds per step (end of one step to the end of the next, so data loading counts) and tokens/s (the batch's
  tokens, padding included, over all devices), medians over the steps after ``--warmup``;
- the phases of a step, measured with CUDA events (CPU: wall clock): target forward, the target's LM head on the
  drafter's states, drafter forward and loss (the rest of the forward), backward, optimizer (gradient clipping,
  AdamW, zero_grad, logging), and the time between steps (data loading); the largest is named;
- peak memory over the training steps (CUDA allocator: allocated and reserved; CPU: the process's max RSS);
- FLOP per step and MFU. The FLOPs are those of the last step (not timed) as ``torch.utils.flop_counter`` counts the
  kernels that run (``2·m·n·k`` per matmul, attention kernels by their dense formula, masked-out positions
  included), forward and backward, split into the phases above. That step runs the drafters' dense attention path
  (the counter cannot trace compiled flex attention), so a flex run's MFU also credits the tiles flex skips::

      FLOP/step = F_target + F_head + F_drafter + F_backward
      F_target   ≈ 2·P_t·T + 4·L_t·T²·H_t·d_t (attention, causal kernels counted dense) + 2·T·d·V (logits)
      F_head     ≈ 2·Q·d·V                     (the target's LM head on the drafter's Q query states)
      F_drafter  ≈ 2·P_d·Q + attention over the drafter's keys + the loss's matmuls
      F_backward ≈ 2 × the forward FLOPs of what needs a gradient (4 × for a layer whose weights train)
      MFU = FLOP/step / (s/step · peak)

  with ``T`` tokens per step, ``P_t`` the target's non-embedding parameters, ``L_t`` layers, ``H_t·d_t`` attention
  width, ``d`` hidden size, ``V`` vocabulary; ``Q`` is anchors × block size for block drafters, the row's positions
  times the unrolled steps for EAGLE-3. ``peak`` is the device's dense bf16 peak (a table of known GPUs, or
  ``--peak-tflops``).

A recipe that fails prints its error and the script goes on to the next; the exit status is 1 if any failed (the
timed steps' summary is written before the FLOP-counted last step, so a failure there or after training still
reports it). ``--attention IMPL`` sets ``model.attention`` (the drafters' training attention), and any key of the
recipe can be set with ``--override KEY=VALUE`` (passed as ``--KEY VALUE`` to ``trainer fit``, e.g.
``--override model.max_anchors=256``). ``--shrink`` builds a tiny shape of the same architecture (8 layers,
width 64, the real vocabulary) and runs on the CPU in seconds::

    OMP_NUM_THREADS=1 python benchmarks/scale.py --shrink --recipes treeflash_qwen3_4b,eagle3_qwen3_8b

``--devices N`` runs each fit on N GPUs, or with ``--shrink`` on N CPU processes over gloo, under the recipe's own
strategy (DDP, FSDP2); on the CPU a DeepSpeed recipe runs as its ZeRO stage's counterpart (:func:`cpu_strategy`:
ZeRO-1/2 as DDP, ZeRO-3 as FSDP2), since Lightning's DeepSpeed needs CUDA. A recipe that trains from a feature
cache (``data.features: offline``) gets one first, built by ``trainer data cache`` from the run's data spec
(:func:`build_cache`). The report also says what ran (strategy, processes, precision, callbacks, checkpointed
drafter layers, optimizer steps, losses); tests/test_gpu_recipes.py runs every GPU recipe so::

    OMP_NUM_THREADS=1 python benchmarks/scale.py --shrink --devices 2 --steps 2 --warmup 1 --no-flops \\
        --recipes specblock_qwen3_8b,specblock_llama31_8b,dflash_qwen3_8b_offline

On a GPU (default: the 4B recipes of DFlash and TreeFlash, 40 steps, their rows of 3072 tokens; sized for a few
minutes, most of them building, saving and loading the 8 GB target, but not yet timed on a GPU)::

    python benchmarks/scale.py [--recipes treeflash_qwen3_4b,dflash_qwen3_4b] [--steps 40] [--work runs/scale]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, PretrainedConfig

from trainer.drafters.attention import dense_attention

# The real shapes, as their hub configs give them (text fields that change the compute or the checkpoint).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_4b": {
        "model_type": "qwen3",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama31_8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
}
# Qwen3-8B: Qwen3-4B's depth, heads, vocabulary and RoPE; wider, with an untied LM head.
SHAPES["qwen3_8b"] = {
    **SHAPES["qwen3_4b"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}
# The MASK token of a DFlash backbone: Qwen3's DFlash drafters use id 151669 (as recipes/dflash_qwen3_4b.yaml);
# for Llama 3.1 the first reserved special token.
MASK_TOKEN = {"qwen3_4b": 151669, "qwen3_8b": 151669, "llama31_8b": 128002}
# --shrink: the same architecture and vocabulary, small enough for a CPU.
SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# Dense bf16 peak FLOP/s by device name (first match wins).
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("GH200", 989e12),
             ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12)]  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ROOT = Path(__file__).resolve().parent.parent


def shape_of(recipe: str) -> str:
    """The shape a recipe's name holds after its drafter (``treeflash_qwen3_4b`` → ``qwen3_4b``, also
    ``dflash_qwen3_8b_offline`` → ``qwen3_8b``)."""
    for name in SHAPES:
        if recipe == name or f"_{name}_" in f"{recipe}_":
            return name
    raise ValueError(f"recipe '{recipe}' names none of the shapes {', '.join(SHAPES)} (recipes/<drafter>_<shape>)")


def target_fields(shape: str, shrink: bool) -> dict[str, Any]:
    """The config fields of ``shape`` (shrunk with ``shrink``)."""
    return {**SHAPES[shape], **(SHRINK if shrink else {})}


def model_config(shape: str, shrink: bool) -> PretrainedConfig:
    """The HF config of ``shape`` (shrunk with ``shrink``)."""
    fields = target_fields(shape, shrink)
    return AutoConfig.for_model(fields["model_type"], **{k: v for k, v in fields.items() if k != "model_type"})


def _matches(directory: Path, fields: dict[str, Any]) -> bool:
    """Whether ``directory`` holds a complete HF model whose config has ``fields``."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return all(config.get(k) == v for k, v in fields.items()) and any(directory.glob("*.safetensors"))


def build_target(shape: str, out: Path, device: torch.device, shrink: bool) -> Path:
    """A randomly initialised causal LM of ``shape`` saved at ``out`` with the tiny tokenizer (reused if there)."""
    from transformers import AutoModelForCausalLM

    from trainer.io import write_dir_atomic

    if _matches(out, target_fields(shape, shrink)):
        print(f"target {shape}: reusing {out}", flush=True)
        return out
    start = time.perf_counter()
    config = model_config(shape, shrink)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    write_dir_atomic(out, functools.partial(save_with_tokenizer, model))
    del model
    empty_cache(device)
    print(f"target {shape}: {params / 1e9:.2f}B parameters -> {out} ({time.perf_counter() - start:.0f} s)", flush=True)
    return out


def save_with_tokenizer(model: torch.nn.Module, out: Path) -> None:
    """``model`` as an HF directory at ``out``, with the shipped tiny target's tokenizer beside it."""
    from trainer.paths import project_path

    model.save_pretrained(out)
    tokenizer = project_path("checkpoints/target_tiny")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)


def build_backbone(shape: str, target: Path, out: Path, device: torch.device, layers: int) -> Path:
    """A random DFlash drafter of ``layers`` layers, block 16, for the target at ``target`` (reused if there)."""
    from trainer.drafters.dflash import DFlashDraftModel, build_config
    from trainer.io import write_dir_atomic

    config = build_config(AutoConfig.from_pretrained(target), layers, 16, MASK_TOKEN[shape])
    if _matches(out, {"hidden_size": config.hidden_size, "num_hidden_layers": layers}):
        print(f"DFlash backbone: reusing {out}", flush=True)
        return out
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = DFlashDraftModel(config).to(dtype)
    write_dir_atomic(out, model.save_pretrained)
    print(f"DFlash backbone: {layers} layers -> {out}", flush=True)
    del model
    empty_cache(device)
    return out


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


class StepClock(Callback):
    """Times every training step by phase, counts the last step's FLOPs, and prints and saves the summary.

    The summary of the timed steps is written before the last step starts, so that a failure of the FLOP counter
    (a dispatch mode over that one step; what it counts is the script's only addition to the step) or of anything
    after training still leaves the timings.

    Args:
        label: the name printed on every line (the recipe).
        report: JSON file written at the end of training with the summary.
        warmup: steps left out of the medians at the start.
        peak_tflops: the device's dense bf16 peak; default from the device name (none on a CPU: no MFU).
        count_flops: count FLOPs (``torch.utils.flop_counter``) on the last step, which is then not timed.
    """

    PHASES = ("target forward", "LM head", "drafter forward and loss", "backward", "optimizer", "between steps")

    def __init__(
        self, label: str, report: str, warmup: int = 5, peak_tflops: float | None = None, count_flops: bool = True
    ) -> None:
        self.label = label
        self.report = Path(report)
        self.warmup = max(warmup, 1)
        self.peak = peak_tflops * 1e12 if peak_tflops else None
        self.count_flops = count_flops
        self.samples: dict[str, list[float]] = {}
        self.flops: dict[str, float] = {}
        self.tokens = 0
        self.steps = 0
        self.optimizer_steps = 0
        self.losses: list[float] = []
        self.run: dict[str, Any] = {}
        self._last_end: Any = None
        self._flop_mode: FlopCounterMode | None = None
        self._counting = ExitStack()

    # ---- marks: CUDA events (the GPU's timeline, host waits included) or wall clock --------------------------
    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def _flop_total(self) -> float:
        return float(self._flop_mode.get_total_flops()) if self._flop_mode is not None else 0.0

    # ---- hooks on the target and its LM head -------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.cuda = pl_module.device.type == "cuda"
        self.device = pl_module.device
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            name = torch.cuda.get_device_name(self.device)
            self.device_name = name
            if self.peak is None:
                self.peak = next((peak for key, peak in PEAK_BF16 if key in name), None)
        else:
            self.device_name = "cpu"
        self._in_target = False
        self._spans: dict[str, list[tuple[Any, Any]]] = {"target forward": [], "LM head": []}
        self._span_flops: dict[str, float] = {"target forward": 0.0, "LM head": 0.0}
        self._open: dict[str, tuple[Any, float]] = {}
        target, head = pl_module.target, pl_module.target.lm_head
        self._handles = [
            target.register_forward_pre_hook(lambda *_: self._enter("target forward")),
            target.register_forward_hook(lambda *_: self._leave("target forward")),
            head.register_forward_pre_hook(lambda *_: self._enter("LM head")),
            head.register_forward_hook(lambda *_: self._leave("LM head")),
        ]
        # An FSDP2 shard (DTensor) counts its whole parameter's elements.
        self.trainable = sum(p.numel() for p in pl_module.trainable_parameters())
        # What ran, as the trainer set it up (after the callbacks' on_fit_start: gradient checkpointing is on).
        self.run = {
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "precision": str(trainer.precision),
            "callbacks": [type(c).__name__ for c in trainer.callbacks],
            "checkpointed_layers": sum(
                bool(getattr(m, "gradient_checkpointing", False)) for m in pl_module.drafter.modules()
            ),
            "trainable_dtype": str(next(iter(pl_module.trainable_parameters())).dtype).removeprefix("torch."),
        }

    def _enter(self, span: str) -> None:
        # The target's own forward calls its LM head: only calls on the drafter's states count as "LM head".
        if span == "LM head" and self._in_target:
            return
        self._in_target |= span == "target forward"
        self._open[span] = (self._mark(), self._flop_total())

    def _leave(self, span: str) -> None:
        if span not in self._open:
            return
        start, flops = self._open.pop(span)
        self._spans[span].append((start, self._mark()))
        self._span_flops[span] += self._flop_total() - flops
        if span == "target forward":
            self._in_target = False

    # ---- the step ------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.tokens = batch["input_ids"].numel() * trainer.world_size
        for span in self._spans:
            self._spans[span].clear()
            self._span_flops[span] = 0.0
        if self.count_flops and self.steps == trainer.max_steps - 1 and self.steps > 0:
            if trainer.is_global_zero:
                self.write_report()
            # The flop counter cannot trace the compiled flex kernel, so the counted step runs the dense path.
            self._counting = ExitStack()
            self._counting.enter_context(dense_attention())
            self._flop_mode = self._counting.enter_context(FlopCounterMode(display=False))
        self._marks = {"start": self._mark()}
        self._mark_flops = {"start": self._flop_total()}

    def _phase_end(self, name: str) -> None:
        self._marks[name] = self._mark()
        self._mark_flops[name] = self._flop_total()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._phase_end("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._phase_end("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._phase_end("end")
        if self.cuda:
            self._marks["end"].synchronize()
        m = self._marks
        spans = {k: sum(self._seconds(a, b) for a, b in v) for k, v in self._spans.items()}
        times = {
            "target forward": spans["target forward"],
            "LM head": spans["LM head"],
            "drafter forward and loss": self._seconds(m["start"], m["forward"]) - sum(spans.values()),
            "backward": self._seconds(m["forward"], m["backward"]),
            "optimizer": self._seconds(m["backward"], m["end"]),
            "between steps": self._seconds(self._last_end, m["start"]) if self._last_end is not None else 0.0,
        }
        step = sum(times.values())
        self._last_end = m["end"]
        counted = self._flop_mode is not None
        if counted:
            f = self._mark_flops
            self.flops = {
                "target forward": self._span_flops["target forward"],
                "LM head": self._span_flops["LM head"],
                "drafter forward and loss": f["forward"] - f["start"] - sum(self._span_flops.values()),
                "backward": f["backward"] - f["forward"],
                "optimizer": f["end"] - f["backward"],
            }
            self._counting.close()
            self._flop_mode = None
        self.steps += 1
        self.optimizer_steps = trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(float(loss))
        timed = self.steps > self.warmup and not counted
        if timed:
            for k, v in {**times, "step": step}.items():
                self.samples.setdefault(k, []).append(v)
        if trainer.is_global_zero:
            parts = " | ".join(f"{k} {v:.3f}" for k, v in times.items())
            tag = " (FLOPs counted)" if counted else "" if timed else " (warm-up)"
            print(f"[{self.label}] step {self.steps}{tag}: {step:.3f} s, {self.tokens / step:,.0f} tok/s | {parts}",
                  flush=True)  # fmt: skip

    def on_train_end(self, trainer, pl_module) -> None:
        for handle in self._handles:
            handle.remove()
        if not trainer.is_global_zero:
            return
        print(format_summary(self.label, self.write_report()), flush=True)

    def write_report(self) -> dict[str, Any]:
        """Write the summary so far to ``report`` (atomically) and return it."""
        from trainer.io import write_text_atomic

        summary = self.summary()
        self.report.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.report, json.dumps(summary, indent=1))
        return summary

    def summary(self) -> dict[str, Any]:
        """The medians over the timed steps, FLOPs, MFU and peak memory (``s_per_step`` None without timed steps)."""
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        step = med.get("step")
        flops = sum(self.flops.values()) if self.flops else None
        out: dict[str, Any] = {
            "device": self.device_name,
            "timed_steps": len(self.samples.get("step", [])),
            "warmup": self.warmup,
            "tokens_per_step": self.tokens,
            "trainable_parameters": self.trainable,
            "optimizer_steps": self.optimizer_steps,
            "losses": self.losses,
            "run": self.run,
            "s_per_step": step,
            "tokens_per_s": self.tokens / step if step else None,
            "phases_s": {k: med[k] for k in self.PHASES if k in med},
            "flops_per_step": flops,
            "flops_by_phase": self.flops,
            "peak_flops": self.peak,
            "mfu": flops / (step * self.peak) if flops and step and self.peak else None,
        }
        if self.cuda:
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 1e9
        else:
            out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        return out


def format_summary(label: str, s: dict[str, Any]) -> str:
    """The summary of one recipe's run as printed lines."""
    if not s["s_per_step"]:
        return f"[{label}] no timed steps: raise --steps above --warmup ({s['warmup']})"
    step = s["s_per_step"]
    lines = [
        f"[{label}] {s['timed_steps']} steps after {s['warmup']} warm-up on {s['device']}: {step:.3f} s/step, "
        f"{s['tokens_per_s']:,.0f} tokens/s ({s['tokens_per_step']} tokens a step), "
        f"{_si(s['trainable_parameters'])} trainable parameters"
    ]
    run = s.get("run")
    if run:
        lines.append(
            f"  ran: {run['strategy']} on {run['world_size']} process(es), precision {run['precision']} (trainable "
            f"{run['trainable_dtype']}), {s['optimizer_steps']} optimizer steps, {run['checkpointed_layers']} "
            f"checkpointed drafter layers, callbacks {', '.join(run['callbacks'])}"
        )
    phases = s["phases_s"]
    largest = max(phases, key=phases.get)
    lines.append(
        "  phases (median s, share): "
        + ", ".join(f"{k} {v:.3f} ({v / step:.0%})" for k, v in phases.items())
        + f"; largest: {largest}"
    )
    if s["flops_per_step"]:
        split = " + ".join(f"{k} {_si(v)}" for k, v in s["flops_by_phase"].items() if v)
        lines.append(f"  FLOP/step {_si(s['flops_per_step'])} = {split} (torch.utils.flop_counter, the last step)")
    if s["mfu"] is not None:
        lines.append(f"  MFU {s['mfu']:.1%} of {s['peak_flops'] / 1e12:.0f} TFLOP/s (dense bf16 peak)")
    if "peak_allocated_gb" in s:
        allocated, reserved = s["peak_allocated_gb"], s["peak_reserved_gb"]
        lines.append(f"  peak memory {allocated:.1f} GB allocated, {reserved:.1f} GB reserved")
    else:
        lines.append(f"  peak memory {s['peak_rss_gb']:.2f} GB resident (process maximum)")
    return "\n".join(lines)


def _si(value: float) -> str:
    """``value`` with an SI prefix: 25.3T, 124M, 8.1k."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


# ---- the driver ----------------------------------------------------------------------------------------------
def cpu_strategy(strategy: Any) -> tuple[Any, str] | None:
    """The strategy a CPU run takes for a recipe's ``strategy`` that cannot run there, and why; None if it can.

    Lightning's DeepSpeed strategy needs CUDA, so ``trainer.strategies.ZeroStrategy`` runs as its counterpart:
    ZeRO stages 1 and 2 keep every parameter on every rank and run DDP's forward and backward (they shard only the
    optimizer state and the gradients, which changes memory, not the step), so ``ddp``; stage 3 also shards the
    parameters, so FSDP2 (``trainer.strategies.FSDP2Strategy``). DDP and FSDP2 run on the CPU over gloo.
    """
    if not isinstance(strategy, dict) or strategy.get("class_path") != "trainer.strategies.ZeroStrategy":
        return None
    stage = int((strategy.get("init_args") or {}).get("stage", 2))
    if stage == 3:
        return {"class_path": "trainer.strategies.FSDP2Strategy"}, "DeepSpeed ZeRO-3 needs CUDA: FSDP2 on the CPU"
    return "ddp", f"DeepSpeed ZeRO-{stage} needs CUDA: DDP on the CPU (ZeRO-{stage} runs DDP's forward and backward)"


def spec_options(args: argparse.Namespace, target: Path) -> dict[str, str]:
    """The data spec keys every run sets (``data.spec.KEY``), the same in a feature cache built for it: the run's
    text data, rows of ``--max-length`` and the target directory's (tiny) tokenizer, which a recipe naming a hub
    tokenizer (``Qwen/Qwen3-8B``) would otherwise compare with the target's."""
    options = {"paths": f"[{args.data}]", "format": "text", "tokenizer": str(target)}
    if args.max_length:
        options["max_length"] = str(args.max_length)
    for item in args.override:
        key, _, value = item.removeprefix("--").partition("=")
        if key.startswith("data.spec."):
            options[key.removeprefix("data.spec.")] = value
    return options


def build_cache(config: dict[str, Any], args: argparse.Namespace, target: Path, out: Path) -> Path:
    """A feature cache for an offline recipe (``data.features: offline``), made by ``trainer data cache`` from the
    run's data spec (the recipe's, with :func:`spec_options`), with the target layers its drafter reads, its top-k
    and its target dtype; resumed (so reused) by a later run of the same arguments."""
    import importlib
    import inspect

    model = config["model"]
    init = dict(model.get("init_args") or {})
    module, _, name = model["class_path"].rpartition(".")
    signature = inspect.signature(getattr(importlib.import_module(module), name))
    layers = init.get("target_layer_ids")
    if not layers:
        if name != "DFlashTraining":
            raise ValueError(f"{name} reads target layers scale.py does not know: give model.target_layer_ids")
        from trainer.drafters.dflash import default_target_layer_ids

        num_layers = init.get("num_layers", signature.parameters["num_layers"].default)
        layers = default_target_layer_ids(AutoConfig.from_pretrained(target).num_hidden_layers, num_layers)
    spec = {**(config["data"].get("init_args") or {}).get("spec", {}), **spec_options(args, target)}
    command = [sys.executable, "-m", "trainer", "data", "cache", "--target", str(target), "--out", str(out)]
    command += ["--layers", json.dumps(list(layers)), "--dtype", init.get("target_dtype", "float32")]
    if init.get("topk"):
        command += ["--topk", str(init["topk"])]
    for key, value in spec.items():
        command += [f"--spec.{key}", value if isinstance(value, str) else json.dumps(value)]
    print(f"feature cache: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True, timeout=args.timeout)
    return out


def fit_command(
    recipe: str,
    args: argparse.Namespace,
    work: Path,
    target: Path,
    backbone: Path | None,
    cache: Path | None = None,
) -> list[str]:
    """``trainer fit`` of a copy of ``recipe`` with :class:`StepClock` among its callbacks, and the overrides
    (on the CPU, a strategy that needs CUDA replaced by :func:`cpu_strategy`'s)."""
    from trainer.recipes import load_recipe, resolve_recipe

    config = load_recipe(resolve_recipe(recipe))
    trainer = config.setdefault("trainer", {})
    substitute = cpu_strategy(trainer.get("strategy")) if args.shrink else None
    if substitute is not None:
        trainer["strategy"], why = substitute
        print(f"[{recipe}] {why}", flush=True)
    callbacks = trainer.get("callbacks") or []
    clock = {
        "label": recipe,
        "report": str(work / "report.json"),
        "warmup": args.warmup,
        "peak_tflops": args.peak_tflops,
        "count_flops": args.flops,
    }
    trainer["callbacks"] = [*callbacks, {"class_path": "scale.StepClock", "init_args": clock}]
    work.mkdir(parents=True, exist_ok=True)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    options = {
        "model.target": str(target),
        "trainer.devices": str(getattr(args, "devices", 1)),
        "trainer.max_steps": str(args.steps),
        # One short validation pass at the last step: the per-depth table and the export still run.
        "trainer.val_check_interval": str(args.steps),
        "trainer.limit_val_batches": str(args.val_batches),
        "trainer.num_sanity_val_steps": "0",
        "trainer.enable_progress_bar": "false",
        "trainer.default_root_dir": str(work),
        **{f"data.spec.{key}": value for key, value in spec_options(args, target).items()},
    }
    if backbone is not None:
        options["model.backbone"] = str(backbone)
    if cache is not None:
        options["data.cache_dir"] = str(cache)
    if args.attention:
        options["model.attention"] = args.attention
    if args.shrink:
        options["trainer.accelerator"] = "cpu"
        if config.get("model", {}).get("init_args", {}).get("max_anchors"):
            options["model.max_anchors"] = "8"
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--override {item!r}: expected KEY=VALUE, e.g. model.max_anchors=256")
        options[key.removeprefix("--")] = value
    return [sys.executable, "-m", "trainer", "fit", "--recipe", str(path)] + [
        word for key, value in options.items() for word in (f"--{key}", value)
    ]


def run_recipe(recipe: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build what ``recipe`` needs, run its fit in a subprocess, and return its summary (raises on failure)."""
    from trainer.recipes import load_recipe, resolve_recipe

    resolve_recipe(recipe)  # an unknown recipe fails before any model is built
    name = Path(recipe).name  # a recipe given by path: recipes/<drafter>_<shape>[.yaml]
    shape = shape_of(name.removesuffix(".yaml"))
    suffix = "_shrink" if args.shrink else ""
    target = build_target(shape, args.work / "targets" / f"{shape}{suffix}", device, args.shrink)
    backbone = None
    if name.startswith("treeflash"):
        out = args.work / "backbones" / f"dflash_{shape}{suffix}"
        backbone = build_backbone(shape, target, out, device, args.backbone_layers)
    cache = None
    config = load_recipe(resolve_recipe(recipe))
    if (config.get("data", {}).get("init_args") or {}).get("features") == "offline":
        cache = build_cache(config, args, target, args.work / "caches" / name.removesuffix(".yaml"))
    work = args.work / "runs" / name
    report = work / "report.json"
    report.unlink(missing_ok=True)
    command = fit_command(recipe, args, work, target, backbone, cache)
    print(f"[{recipe}] {' '.join(command[1:])}", flush=True)
    env = dict(os.environ)
    # The callback's module (this file, as `scale`) comes last, so the scripts beside it shadow nothing.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"), str(Path(__file__).parent)) if p)
    start = time.perf_counter()
    try:
        rc = subprocess.run(command, env=env, timeout=args.timeout).returncode
        error = f"trainer fit exited with status {rc}" if rc else None
    except subprocess.TimeoutExpired:
        error = f"trainer fit ran past --timeout {args.timeout:g} s"
    if not report.is_file():
        raise RuntimeError(error or f"trainer fit ended without a report at {report}")
    # The timed steps' summary is written before the FLOP-counted last step: a later failure keeps it.
    summary = json.loads(report.read_text())
    summary["wall_s"] = time.perf_counter() - start
    if error:
        hint = "; if its trace runs through flop_counter, run again with --no-flops" if args.flops else ""
        summary["error"] = f"{error} after the timed steps{hint}"
        print(f"[{recipe}] failed: {summary['error']}", flush=True)
    return summary


def print_table(results: dict[str, dict[str, Any] | str]) -> None:
    """One line per recipe: the summary figures side by side, or the error."""
    header = f"{'recipe':<22} {'s/step':>7} {'tok/s':>9} {'MFU':>6} {'peak GB':>8} {'fit s':>6}  largest phase"
    print("\n" + header + "\n" + "-" * len(header))
    for recipe, s in results.items():
        if isinstance(s, str):
            print(f"{recipe:<22} failed: {s}")
            continue
        if not s["s_per_step"]:
            print(f"{recipe:<22} no timed steps")
            continue
        peak = s.get("peak_allocated_gb", s.get("peak_rss_gb"))
        mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "-"
        phases = s["phases_s"]
        largest = max(phases, key=phases.get)
        print(
            f"{recipe:<22} {s['s_per_step']:>7.3f} {s['tokens_per_s']:>9,.0f} {mfu:>6} {peak:>8.1f} "
            f"{s['wall_s']:>6.0f}  {largest} ({phases[largest] / s['s_per_step']:.0%})"
        )
        if "error" in s:
            print(f"{'':<22} then failed: {s['error']}")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="treeflash_qwen3_4b,dflash_qwen3_4b", help="comma-separated recipe names")
    p.add_argument("--steps", type=int, default=40, help="training steps per recipe, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--max-length", type=int, default=0, help="tokens per row (default: the recipe's)")
    p.add_argument("--data", default="stdlib:train", help="text data of the run (a path or stdlib:SPLIT)")
    p.add_argument("--val-batches", type=int, default=2, help="batches of the validation pass at the last step")
    p.add_argument("--backbone-layers", type=int, default=5, help="layers of TreeFlash's random DFlash backbone")
    p.add_argument("--work", type=Path, default=Path("runs/scale"), help="targets, backbones and runs go here")
    attention = "the drafters' training attention, model.attention (e.g. flex, dense); default: the recipe's"
    p.add_argument("--attention", help=attention)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="a recipe key, repeatable")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: by name)")
    flops = "count FLOPs on the last step (then not timed)"
    p.add_argument("--flops", action=argparse.BooleanOptionalAction, default=True, help=flops)
    p.add_argument("--timeout", type=float, default=None, help="seconds a recipe's fit may take")
    p.add_argument("--shrink", action="store_true", help="a tiny shape of each architecture, on the CPU")
    devices = "processes (GPUs; with --shrink, CPU processes over gloo) each recipe's fit runs its strategy on"
    p.add_argument("--devices", type=int, default=1, help=devices)
    p.add_argument("--smoke", action="store_true", help="--shrink with 3 steps of short rows: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.shrink, args.steps, args.warmup, args.val_batches = True, 4, 1, 1
        if args.recipes == p.get_default("recipes"):
            # Both architectures, both strategies (FSDP2, DDP), a built backbone and a data-made draft vocabulary.
            args.recipes = "treeflash_qwen3_4b,eagle3_llama31_8b"
    if args.shrink:
        args.data = "stdlib:validation" if args.data == "stdlib:train" else args.data
        args.max_length = min(args.max_length or 128, 128)
    args.work = args.work.resolve()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.shrink else "cpu")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    start = time.perf_counter()
    results: dict[str, dict[str, Any] | str] = {}
    for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        try:
            results[recipe] = run_recipe(recipe, args, device)
        except Exception as e:  # one recipe failing must not stop the others
            print(f"[{recipe}] failed: {type(e).__name__}: {e}", flush=True)
            results[recipe] = f"{type(e).__name__}: {e}"
        empty_cache(device)
    print_table(results)
    print(f"{time.perf_counter() - start:.0f} s in all (building, saving and loading included)")
    sys.exit(1 if any(isinstance(s, str) or "error" in s for s in results.values()) else 0)


if __name__ == "__main__":
    main()
