"""What every drafter LightningModule shares: the frozen target, checkpoints without it, the optimiser, export.

A subclass builds its drafter in ``build_drafter``. ``configure_model`` loads the target from its path, checks
that the drafter fits it and wraps it as a frozen :class:`~trainer.target.Target` that returns the drafter's
layers; checkpoints hold the drafter only, and the end of fit writes the drafter as an HF directory.

Validation metrics are sums over an epoch (``MetricSums``): a validation step adds its batch's sums (per depth,
per unrolled step, per (block, slot): any shape, the same every batch); the epoch's means are the sums divided
by a count that was summed alongside them, and ``show_table`` prints the table a run ends with.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from trainer.data.pack import loss_token_counts
from trainer.drafters.attention import AttentionPath
from trainer.drafters.common import SdpaDrafter
from trainer.drafters.families import family_of
from trainer.drafters.vocab import DraftVocab
from trainer.errors import UserError
from trainer.io import write_dir_atomic
from trainer.optim import adamw_warmup_cosine
from trainer.paths import project_path
from trainer.target import Target, decoder_layers, load_causal_lm


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with whole tensors under FSDP2 (DTensor shards) or DeepSpeed ZeRO-3 (partitioned
    parameters): a collective, so every rank calls it."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def clip_grad_norm_mixed(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their joint L2 norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does, for a mix of FSDP2 shards (DTensor gradients: their squares summed
    over the mesh, a collective every rank calls) and replicated tensors (equal on every rank). Returns the norm
    before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = [g.float().pow(2).sum() for g in grads]
    total = torch.stack([s.full_tensor() if isinstance(s, DTensor) else s for s in squares]).sum().sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


class MetricSums:
    """Named sums over one validation epoch, detached and on the CPU."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, sums: Mapping[str, torch.Tensor]) -> None:
        for key, value in sums.items():
            value = value.detach().cpu()
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def clear(self) -> None:
        self.sums = {}

    def __bool__(self) -> bool:
        return bool(self.sums)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.sums[key]

    def mean(self, stat: str, count: str) -> torch.Tensor:
        """``stat`` per counted item; 0 where ``count`` is 0."""
        return self.sums[stat] / self.sums[count].clamp(min=1)


def show_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """Print a table of already formatted cells on the console."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console().print(table)


class FrozenTargetTraining(L.LightningModule):
    """Base of the LightningModules that train a drafter against a frozen target.

    The arguments below mean the same in every family; a subclass declares its own arguments and passes these
    on with ``**kwargs`` (re-declaring one only to give its family another default), so the recipe schema of a
    family is its signature plus this one.

    Args:
        target: HF causal LM (directory or hub id) the drafter is trained against.
        target_dtype: the target's compute dtype.
        topk: teacher tokens per position (online features; offline takes the cache's).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices.
        warmup_steps: linear warm-up steps.
        min_lr_ratio: cosine floor as a fraction of ``lr``.
        export_dir: HF directory written at the end of fit; default ``<run>/hf``.
        attention: how the training masks run (:mod:`trainer.drafters.attention`): ``flex`` block masks and
            flex attention (compiled; needs CUDA to train), ``dense`` float masks and SDPA, or ``auto`` (flex on
            CUDA, dense elsewhere).
    """

    # The drafter family as messages name it ("DFlash", "EAGLE-3", ...).
    family: ClassVar[str]

    def __init__(
        self,
        target: str,
        target_dtype: str = "float32",
        topk: int = 32,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        export_dir: str | None = None,
        attention: AttentionPath = "auto",
    ) -> None:
        super().__init__()
        # Checkpoints and TensorBoard record every family's arguments, these and the subclass's alike.
        self.save_hyperparameters()
        self.target_path = target
        self.target_dtype = target_dtype
        self.topk = topk
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.export_dir = export_dir
        self.attention = attention
        self.target: Target | None = None
        self.drafter: torch.nn.Module | None = None
        self.val_sums = MetricSums()
        # The global step whose weights the last validation pass saw; None before one (the sanity check's
        # untrained weights do not count).
        self.validated_step: int | None = None

    # ---- model --------------------------------------------------------------------------------------------
    @abstractmethod
    def build_drafter(self, target: PreTrainedModel) -> torch.nn.Module:
        """The family's drafter for ``target`` (new, or loaded from the recipe's checkpoint)."""

    def configure_model(self) -> None:
        if self.drafter is not None:
            return
        model = load_causal_lm(str(project_path(self.target_path)), self.target_dtype)
        self.drafter = self.build_drafter(model)
        for module in self.drafter.modules():
            if isinstance(module, SdpaDrafter):
                module.attention = self.attention
        self.check_drafter_fits(model.config)
        self.target = Target(model, self.layer_ids)
        if self.device_mesh is not None:
            self.shard(self.device_mesh["data_parallel"])

    def shard(self, mesh: Any) -> None:
        """FSDP2 (``trainer.strategies.FSDP2Strategy``): shard every decoder layer of the frozen target and of the
        drafter over ``mesh``. Each layer is called through its own forward, which gathers its parameters; the
        rest (target embedding, norm and LM head, which the drafters also call directly; the drafter's fc, norms
        and heads) stays replicated, its gradients averaged over the mesh in ``on_before_optimizer_step``."""
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(self.target.model):
            fully_shard(layer, mesh=mesh)
        layer = family_of(self.drafter).layer
        for module in self.drafter.modules():
            if isinstance(module, layer):
                fully_shard(module, mesh=mesh)
        self._replicated_mesh = mesh

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        mesh = getattr(self, "_replicated_mesh", None)
        if mesh is None:
            return
        group = mesh.get_group()
        for p in self.trainable_parameters():
            # Sharded (DTensor) parameters had theirs reduce-scattered by FSDP2 already.
            if p.grad is not None and not isinstance(p, DTensor):
                # A sum then a division: gloo (CPU) has no average.
                torch.distributed.all_reduce(p.grad, group=group)
                p.grad.div_(mesh.size())

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        # Under FSDP2 the trainable parameters mix DTensor shards and replicated tensors, which torch's
        # clip_grad_norm_ refuses; clipping by value needs no norm, so Lightning's own path does.
        sharded = getattr(self, "_replicated_mesh", None) is not None
        if not sharded or not gradient_clip_val or gradient_clip_algorithm == "value":
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        clip_grad_norm_mixed(self.trainable_parameters(), gradient_clip_val)

    @property
    def layer_ids(self) -> list[int]:
        """Target layer ids the drafter reads (HF ``hidden_states[l + 1]``)."""
        return list(self.drafter.target_layer_ids)

    def load_drafter(self, model_class: type[PreTrainedModel], init_from: str) -> PreTrainedModel:
        """The ``model_class`` drafter saved at ``init_from``, in float32."""
        path = project_path(init_from)
        if not (path / "config.json").is_file():
            raise UserError(f"model.init_from: no {self.family} checkpoint at {path}")
        return model_class.from_pretrained(str(path), dtype=torch.float32)

    def adopt_training_vocab(self, drafter: torch.nn.Module, target: PreTrainedModel, init_head: bool) -> None:
        """Give ``drafter`` (a :class:`~trainer.drafters.common.DraftVocabHead` with an ``lm_head``) the most
        frequent loss-masked tokens of the training rows the attached datamodule serves as its draft vocabulary,
        and with ``init_head`` start its ``lm_head`` from the target's LM-head rows of those tokens."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if datamodule is None:
            raise UserError(
                f"a new {self.family} drafter takes its draft vocabulary from the training data: fit it with a "
                "datamodule, or set model.init_from to a drafter that has one"
            )
        # configure_model runs after the datamodule's setup and before a checkpoint restores the data position,
        # so building the loader here neither fails nor moves a resumed run's position.
        dataset = datamodule.train_dataloader().dataset
        counts = loss_token_counts(
            (dataset[i] for i in range(len(dataset))), target.config.get_text_config().vocab_size
        )
        size = drafter.lm_head.out_features
        drafter.set_draft_vocab(DraftVocab.from_counts(counts, size))
        if init_head:
            with torch.no_grad():
                rows = drafter.to_target(torch.arange(size))
                drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[rows].float())

    def fit_problems(self, target: PretrainedConfig) -> list[str]:
        """What keeps the drafter from running on ``target`` (the target's text config); empty when it fits."""
        problems = []
        hidden_size = self.drafter.config.hidden_size
        if hidden_size != target.hidden_size:
            problems.append(f"hidden size {hidden_size} vs the target's {target.hidden_size}")
        if max(self.layer_ids) >= target.num_hidden_layers:
            problems.append(f"target layer ids {self.layer_ids} but the target has {target.num_hidden_layers} layers")
        return problems

    def check_drafter_fits(self, target_config: PretrainedConfig) -> None:
        """A drafter made for another target fails here with what differs, not deep inside a forward."""
        problems = self.fit_problems(target_config.get_text_config())
        if problems:
            raise UserError(
                f"the {self.family} drafter does not fit the target '{self.target_path}': " + "; ".join(problems)
            )

    def on_fit_start(self) -> None:
        cache = getattr(self.trainer.datamodule, "feature_cache", None)
        if cache is not None and cache.manifest["config"]["layers"] != self.layer_ids:
            raise UserError(
                f"the feature cache {cache.root} holds target layers {cache.manifest['config']['layers']}, "
                f"the drafter reads {self.layer_ids}; rebuild it with trainer data cache --layers '{self.layer_ids}'"
            )

    # ---- optimisation, checkpoints, export ----------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def configure_optimizers(self) -> Any:
        params = self.trainable_parameters()
        if not params:
            raise UserError("nothing to train: every drafter parameter is frozen")
        return adamw_warmup_cosine(
            params,
            self.lr,
            self.weight_decay,
            self.warmup_steps,
            self.trainer.estimated_stepping_batches,
            self.min_lr_ratio,
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # The frozen target is rebuilt from its path; checkpoints hold the drafter (buffers included) only.
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("target.")}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in missing if not k.startswith("target.")]
        if strict and (missing or unexpected):
            raise RuntimeError(f"checkpoint does not match the drafter: missing {missing}, unexpected {unexpected}")
        return missing, unexpected

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The drafter's HF config beside its weights: `trainer export` rebuilds the drafter from a checkpoint
        # alone, without the target or the training data (an EAGLE-3 vocabulary is built from the data).
        checkpoint["drafter_config"] = self.drafter.config.to_dict()

    def export(self) -> Path | None:
        """Write the drafter as an HF directory (``export_dir`` or ``<run>/hf``) on rank 0; every rank must call it,
        since sharded weights are gathered first (a collective). Returns the directory on rank 0."""
        state = full_state_dict(self.drafter)
        # Every rank asks: under DDP and FSDP2 the trainer's log_dir is rank 0's, broadcast (a collective too).
        out = Path(self.export_dir or Path(self.trainer.log_dir or ".") / "hf")
        if not self.trainer.is_global_zero:
            return None
        write_dir_atomic(out, lambda tmp: self.drafter.save_pretrained(tmp, state_dict=state))
        return out

    # ---- validation metrics -------------------------------------------------------------------------------------
    # A validation step adds its batch's sums to ``val_sums``; at the end of the epoch ``validation_metrics``
    # turns them into the logged means and ``print_table`` into the printed table.
    def on_validation_epoch_start(self) -> None:
        self.val_sums.clear()

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            # The sanity pass sees untrained weights: its sums reach neither the logs nor the table printed at
            # the end of fit.
            self.val_sums.clear()
            return
        self.validated_step = self.trainer.global_step
        for name, value in self.validation_metrics().items():
            self.log(name, value, sync_dist=True)
        if self.trainer.state.fn == "validate" and self.trainer.is_global_zero:
            self.print_table()

    @abstractmethod
    def validation_metrics(self) -> dict[str, float]:
        """The logged means of the sums of this validation epoch, by TensorBoard tag."""

    @abstractmethod
    def print_table(self) -> None:
        """Print the table of the validation metrics gathered so far (nothing when there are none); a
        ``trainer validate`` run prints it, and ``trainer fit`` prints that of the trained weights at the end."""

    def on_fit_end(self) -> None:
        out = self.export()
        if self.trainer.is_global_zero:
            print(f"{self.family} drafter -> {out}")
