"""Training throughput per drafter family, as ratios to the floor each mode cannot go below.

For DFlash, TreeFlash, EAGLE-3 and SpecBlock, each built from its tiny recipe (``recipes/*_tiny.yaml``) on the
shipped tiny target, one training step (forward, backward, AdamW step) on the same batch of stdlib code:

- online (the target runs in the step): step time as a ratio to the frozen target's bare forward on the same
  batch, the floor of any online trainer (goal: at most 1.3x);
- offline (features read from a cache, here computed once beforehand): step time as a ratio to the drafter's own
  forward and backward within that step;
- the memory of one training mask at ``dflash_qwen3_4b``'s shapes on each attention path (dense float mask,
  flex block mask; CUDA: the peak of building it too);
- tokens/s of both, peak memory of the step (CUDA: allocator peak; CPU: resident-set growth), and the largest
  phase above each floor: feature extraction (hooks, packed mask, top-k beyond the bare forward), drafter forward,
  LM head (the target's, on the drafter's states), batch building and loss (anchors, blocks, masks, KL), backward,
  optimizer.

Phases are timed by forward hooks on the drafter's modules and the target's LM head; what the step spends outside
them is batch building and loss. Times are medians of ``--repeats`` steps after a warm-up. On CPU::

    OMP_NUM_THREADS=1 python benchmarks/train_throughput.py [--batch-size 4] [--length 512] [--repeats 5] [--smoke]

On a GPU, ``--device cuda`` (the default where one is found).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from trainer.data.features import with_features
from trainer.data.prepare import DataSpec
from trainer.drafters.attention import describe_4b
from trainer.paths import project_path
from trainer.target import Target, load_causal_lm
from trainer.tiny.corpus import list_modules
from trainer.training.datamodule import DraftData

# Family -> its tiny recipe and the init arguments set over the recipe's. A new EAGLE-3 or SpecBlock drafter takes
# its draft vocabulary from the training data, which a bare step has none of: those two start from their shipped
# checkpoints (the same architecture, vocabulary included; the weights do not change a step's cost).
FAMILIES = {
    "DFlash": ("dflash_tiny", {}),
    "TreeFlash": ("treeflash_tiny", {}),
    "EAGLE-3": ("eagle3_tiny", {"init_from": "checkpoints/eagle3_tiny"}),
    "SpecBlock": ("specblock_tiny", {"init_from": "checkpoints/specblock_tiny"}),
}


class PhaseClock:
    """Wall time spent in top-level calls of a group of modules (nested calls within the group count once)."""

    def __init__(self, modules: list[torch.nn.Module], skip_while: Callable[[], bool] = lambda: False) -> None:
        self.total = 0.0
        self._depth = 0
        self._start = 0.0
        self._skip = skip_while
        self._handles = [
            h for m in modules for h in (m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave))
        ]

    @property
    def active(self) -> bool:
        """Whether a call of the group is running now."""
        return self._depth > 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, module, args) -> None:
        if self._skip():
            return
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, module, args, output) -> None:
        if self._skip() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self.total += time.perf_counter() - self._start


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """``{"mb": peak}`` of the block: CUDA allocator peak, or on CPU the resident-set growth sampled every ms."""
    out = {"mb": 0.0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield out
        out["mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return
    base = resident_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out["mb"] = (peak[0] - base) / 2**20


def resident_bytes() -> int:
    """This process's resident set (Linux ``/proc``; 0 where there is none, so CPU peaks then read 0)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(batch_size: int, length: int, tokenizer: str) -> dict[str, torch.Tensor]:
    """One batch of ``batch_size`` packed rows of ``length`` tokens of stdlib code (validation split)."""
    with tempfile.TemporaryDirectory() as tmp:
        for m in list_modules("validation")[:40]:
            (Path(tmp) / f"{m.name}.py").write_bytes(m.path.read_bytes())
        spec = DataSpec(paths=[tmp], format="text", tokenizer=tokenizer, max_length=length, validation_fraction=0.05)
        data = DraftData(spec, batch_size=batch_size)
        return next(iter(data.train_dataloader()))


def build_module(recipe: str, overrides: dict[str, str], model: torch.nn.Module):
    """The recipe's LightningModule (init arguments ``overrides`` over the recipe's) with its drafter built for
    ``model`` and the frozen target attached."""
    config = yaml.safe_load(project_path(f"recipes/{recipe}.yaml").read_text())["model"]
    module_name, class_name = config["class_path"].rsplit(".", 1)
    module = getattr(importlib.import_module(module_name), class_name)(**{**config["init_args"], **overrides})
    module.drafter = module.build_drafter(model)
    module.target = Target(model, module.layer_ids)
    return module


def measure(module, batch, repeats: int, device: torch.device, floor: Callable[[], object]) -> dict[str, float]:
    """Median phase times (s) of a full training step, and of ``floor`` run just before each step (on a shared
    machine the load drifts; interleaving keeps each ratio side by side). A batch without features has the
    target compute them in the step."""
    optimizer = torch.optim.AdamW(module.trainable_parameters(), lr=1e-4)
    target = PhaseClock([module.target])
    drafter = PhaseClock(list(module.drafter.modules()))
    # The target's own forward calls its LM head too; only the calls on the drafter's states count here.
    head = PhaseClock([module.target.lm_head], skip_while=lambda: target.active)
    samples: dict[str, list[float]] = {}
    peak = 0.0
    for i in range(repeats + 1):
        drafter.total = head.total = target.total = 0.0
        floor_time = median_time(floor, 0, device)
        with peak_memory(device) as mem:
            sync(device)
            t0 = time.perf_counter()
            loss = module.training_step(batch, 0)
            sync(device)
            t1 = time.perf_counter()
            loss.backward()
            sync(device)
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            t3 = time.perf_counter()
        if i == 0:
            continue  # warm-up
        peak = max(peak, mem["mb"])
        phases = {
            "target": target.total,
            "drafter forward": drafter.total,
            "LM head": head.total,
            "batch building and loss": (t1 - t0) - target.total - drafter.total - head.total,
            "backward": t2 - t1,
            "optimizer": t3 - t2,
            "step": t3 - t0,
            "floor": floor_time,
        }
        for k, v in phases.items():
            samples.setdefault(k, []).append(v)
    for clock in (target, drafter, head):
        clock.remove()
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["peak_mb"] = peak
    return out


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``repeats`` calls after a warm-up call (``repeats=0``: the one call)."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i or not repeats:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="one row of 64 tokens, one repeat: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.batch_size, args.length, args.repeats = 1, 64, 1
    device = torch.device(args.device)
    target_dir = str(project_path("checkpoints/target_tiny"))
    model = load_causal_lm(target_dir, "float32").to(device).eval().requires_grad_(False)
    batch = {k: v.to(device) for k, v in make_batch(args.batch_size, args.length, target_dir).items()}
    tokens = batch["input_ids"].numel()

    table = Table(title=f"training step, {args.batch_size} x {args.length} tokens, {device.type}")
    for column in (
        "family",
        "online tok/s",
        "online / target fwd",
        "largest above target fwd",
        "offline tok/s",
        "offline / drafter fwd+bwd",
        "largest above drafter fwd+bwd",
        "peak MB on / off",
    ):
        table.add_column(column)

    def bare_forward() -> None:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)

    floors: list[float] = []
    for family, (recipe, overrides) in FAMILIES.items():
        torch.manual_seed(0)
        module = build_module(recipe, overrides, model).to(device)
        module.train()
        online = measure(module, batch, args.repeats, device, bare_forward)
        floor = online["floor"]
        floors.append(floor)
        with torch.no_grad():
            cached = with_features(batch, module.target, module.topk)
        offline = measure(module, cached, args.repeats, device, bare_forward)

        # Feature extraction beyond the bare forward, the two timed alternately.
        extraction = statistics.median(
            median_time(lambda m=module: with_features(batch, m.target, m.topk), 0, device)
            - median_time(bare_forward, 0, device)
            for _ in range(args.repeats)
        )
        above_target = {
            "feature extraction": extraction,
            **{
                k: online[k] for k in ("drafter forward", "LM head", "batch building and loss", "backward", "optimizer")
            },
        }
        own = offline["drafter forward"] + offline["backward"]
        above_own = {k: offline[k] for k in ("LM head", "batch building and loss", "optimizer")}
        name_on = max(above_target, key=above_target.get)
        name_off = max(above_own, key=above_own.get)
        table.add_row(
            family,
            f"{tokens / online['step']:,.0f}",
            f"{online['step'] / floor:.2f}x",
            f"{name_on} {above_target[name_on] / floor:.2f}x",
            f"{tokens / offline['step']:,.0f}",
            f"{offline['step'] / own:.2f}x",
            f"{name_off} {above_own[name_off] / own:.2f}x",
            f"{online['peak_mb']:.0f} / {offline['peak_mb']:.0f}",
        )
    Console(width=200).print(table)
    low, high = min(floors), max(floors)
    print(f"floor: target forward {low * 1e3:.0f}-{high * 1e3:.0f} ms for {tokens} tokens across the families' runs")
    # The tiny recipes' masks are small; the paths differ at a real recipe's shapes (one row, CUDA: with the peak
    # of building each).
    print(f"training mask of one dflash_qwen3_4b row (512 blocks of 16, 3072 tokens): {describe_4b(device)}")


if __name__ == "__main__":
    main()
