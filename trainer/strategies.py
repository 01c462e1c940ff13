"""Sharded training through Lightning's strategies, with checkpoints a kill cannot tear.

A recipe picks one as ``trainer.strategy``:

- ``ddp``: Lightning's own; every rank holds the drafter and the frozen target, and rank 0 writes a single-file
  checkpoint through the recipe's :class:`~trainer.checkpoint_io.AtomicCheckpointIO`.
- ``{class_path: trainer.strategies.FSDP2Strategy}``: ``ModelParallelStrategy`` (FSDP2, ``fully_shard``) over a
  data-parallel mesh; the LightningModule shards the decoder layers of the frozen target and of the drafter
  (:meth:`trainer.training.frozen_target.FrozenTargetTraining.shard`).
- ``{class_path: trainer.strategies.ZeroStrategy, init_args: {stage: 2|3}}``: DeepSpeed ZeRO (CUDA only; an
  optional extra: ``pip install -e '.[deepspeed]'``).

A sharded checkpoint is a directory that every rank writes its part of. Both sharded strategies write it as
``NAME.partial`` and rank 0 renames it to ``NAME`` once every rank has finished (:func:`trainer.io.swap_in`), so
``--ckpt_path last`` after a SIGKILL finds the previous checkpoint whole or the new one whole.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from trainer.io import partial_path, swap_in

if not torch.cuda.is_available():
    # Lightning imports DeepSpeed (when installed) to check that it is there; without CUDA, DeepSpeed picks its CPU
    # accelerator and announces that on stdout, which would corrupt `trainer fit --print_config`'s YAML.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


class AtomicDirectorySave:
    """Mixin for a Lightning strategy whose checkpoints are directories written by every rank: write, then swap."""

    def saves_directory(self) -> bool:
        return True

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not self.saves_directory():
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(filepath))
        tmp = partial_path(path)
        if self.global_rank == 0 and tmp.exists():
            # A kill during an earlier save left it; it was never the checkpoint.
            shutil.rmtree(tmp)
        self.barrier("checkpoint_clean")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("checkpoint_written")
        if self.global_rank == 0:
            swap_in(path)
        self.barrier("checkpoint_swapped")


class FSDP2Strategy(AtomicDirectorySave, ModelParallelStrategy):
    """``ModelParallelStrategy`` as FSDP2 over every rank (no tensor parallelism), with atomic checkpoints.

    Args:
        data_parallel_size: ranks the parameters are sharded over; ``auto`` = every rank.
        save_distributed_checkpoint: one shard per rank in a directory (``trainer export`` and a resume on another
            number of ranks read it too); ``False`` gathers a single file on rank 0.
        timeout_minutes: collective timeout.
    """

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        save_distributed_checkpoint: bool = True,
        timeout_minutes: int = 30,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            timeout=timedelta(minutes=timeout_minutes),
        )

    def setup_environment(self) -> None:
        # Lightning's "auto" shards over the nodes only (tensor parallelism within); here every rank is a replica.
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def saves_directory(self) -> bool:
        return self._save_distributed_checkpoint


class ZeroStrategy(AtomicDirectorySave, DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` (ZeRO stage 2 or 3; see its arguments), with atomic checkpoints."""
