"""A short DFlash fit on CPU for the distributed tests (tests/test_distributed.py), one process per rank.

    python tests/dist_fit.py ROOT OUT --strategy ddp --devices 2 --steps 4

``ROOT`` holds ``target/`` and ``text/`` (conftest.make_target_dirs); each rank writes its training losses to
``OUT/losses_rank{r}.json`` and rank 0 the drafter's final (full) weights to ``OUT/drafter.pt``. Lightning's
subprocess launcher starts the other ranks by running this file again.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from trainer.callbacks import GradientCheckpointing
from trainer.checkpoint_io import AtomicCheckpointIO
from trainer.data.prepare import DataSpec
from trainer.strategies import FSDP2Strategy
from trainer.training.datamodule import DraftData
from trainer.training.dflash import DFlashTraining


class Recorded(DFlashTraining):
    """DFlash training that keeps every micro-batch's loss (with accumulation, several per optimizer step)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.recorded.append(float(loss.detach()))
        return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--ckpt-path")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the drafter")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    module = Recorded(
        target=str(args.root / "target"),
        num_layers=1,
        block_size=4,
        max_anchors=4,
        loss="kl",
        lr=3e-3,
        warmup_steps=0,
        mask_token_id=3,
        seed=0,
        export_dir=str(args.out / "hf"),
    )
    module.recorded = []
    spec = DataSpec(
        paths=[str(args.root / "text")],
        format="text",
        tokenizer=str(args.root / "target"),
        max_length=48,
        validation_fraction=0.1,
    )
    data = DraftData(spec, batch_size=1)
    strategy = args.strategy
    if strategy == "fsdp2":
        strategy = FSDP2Strategy()
    elif strategy.startswith("deepspeed_stage_"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=int(strategy[-1]), process_group_backend="gloo")
    callbacks = [GradientCheckpointing()] if args.checkpointing else []
    if args.save_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=args.out / "checkpoints", save_last=True, every_n_train_steps=args.save_every, save_top_k=-1
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        gradient_clip_val=None,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"losses_rank{trainer.global_rank}.json").write_text(json.dumps(module.recorded))
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.drafter.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(state, args.out / "drafter.pt")


if __name__ == "__main__":
    main()
