"""The frozen target model: one forward gives the hidden states of chosen layers and the logits.

Every drafter trains against this interface. Layer ids follow the HF convention: layer id ``l`` is the output
of decoder layer ``l`` (0-based), i.e. ``hidden_states[l + 1]`` of an HF forward with
``output_hidden_states=True`` (``hidden_states[0]`` is the embedding output). The states are captured with
forward hooks on the chosen layers only, so a 36-layer target does not materialise 37 copies of its
activations. For the last layer the hook sees the decoder layer's own output, before the final norm.

On CPU with the shipped tiny target::

    python -c "from trainer.target import Target; t = Target.from_pretrained('checkpoints/target_tiny', [1, 4]); \\
        import torch; o = t(torch.tensor([[1, 2, 3]])); print(o.features.shape, o.logits.shape)"
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trainer.errors import UserError
from trainer.paths import project_path


@dataclass
class TargetOutput:
    # One tensor per requested layer id, in the requested order. Shape: (B, T, H)
    hidden_states: list[torch.Tensor]
    # Shape: (B, T, V), or None when logits were not asked for
    logits: torch.Tensor | None

    @property
    def features(self) -> torch.Tensor:
        """The drafter's input feature: requested layers concatenated. Shape: (B, T, n_layers * H)"""
        return torch.cat(self.hidden_states, dim=-1)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise UserError(f"unknown dtype '{dtype}'; use e.g. float32, bfloat16, float16")
    return value


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layer stack of an HF causal LM (``model.model.layers`` for Llama/Qwen-style models)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UserError(f"{type(model).__name__} has no decoder stack at .{model.base_model_prefix}.layers")
    return layers


@contextmanager
def capture_layers(model: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, forwards of ``model`` leave the output of each decoder layer in ``layer_ids`` in the
    yielded dict (layer id -> Shape (B, T, H), the last forward's). Hooks on those layers only: transformers'
    ``output_hidden_states`` records every layer through its output recorder, a cost per layer and forward that
    the decoding engines avoid. The hooks are removed on leaving."""
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def keeper(layer_id: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(keeper(i)) for i in sorted(set(layer_ids))]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def layer_features(states: dict[int, torch.Tensor], layer_ids: Sequence[int], index: tuple) -> torch.Tensor | None:
    """A drafter's input feature from captured layers (``capture_layers``): ``states[l][index]`` of each layer in
    ``layer_ids``, concatenated on the last dim (indexed first, so only the chosen positions are copied); None
    when the drafter reads no layers."""
    if not layer_ids:
        return None
    return torch.cat([states[layer][index] for layer in layer_ids], dim=-1)


# ``sdpa`` for a target that verifies trees on CPU (the default of ``load_causal_lm``): see ``_grouped_sdpa``.
GROUPED_SDPA = "sdpa_grouped"


def _grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa``, except that a masked call with several query tokens on CPU attends each group of
    query heads to its shared key/value head in place (``enable_gqa``): the stock function copies the whole KV
    cache to every query head there (``repeat_kv``), in every layer of every tree verification step. Same values
    bit for bit on CPU (tested); on other devices the stock function, whose fused kernels need that copy.
    Shapes: query (B, H, T, D), key/value (B, H_kv, L, D) -> (B, T, H, D)"""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (
        not grouped
        or attention_mask is None
        or query.shape[2] == 1
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def load_causal_lm(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = GROUPED_SDPA,
    device: str | torch.device | None = None,
) -> PreTrainedModel:
    """An HF causal LM by hub id or local path (a shipped one from any directory, ``trainer.paths``); a clear
    UserError when it cannot be loaded."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(project_path(name_or_path)), dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as e:
        where = "local directory" if Path(name_or_path).exists() else "local path nor a reachable hub id"
        raise UserError(f"cannot load target '{name_or_path}' ({where}): {e}") from None
    return model.to(device) if device is not None else model


class Target(nn.Module):
    """A frozen HF causal LM that returns the hidden states of ``layer_ids`` and the logits in one forward."""

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int]) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise UserError(f"target layer ids {bad} out of range: the target has layers 0..{self.num_layers - 1}")
        self.layer_ids = list(layer_ids)

    def train(self, mode: bool = True) -> Target:
        # A parent module's .train() must not switch the frozen target out of eval mode.
        return super().train(False)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        layer_ids: Sequence[int],
        dtype: str | torch.dtype = "float32",
        attn_implementation: str = GROUPED_SDPA,
        device: str | torch.device | None = None,
    ) -> Target:
        """Load an HF causal LM by hub id or local path, frozen, in ``dtype``."""
        return cls(load_causal_lm(name_or_path, dtype, attn_implementation, device), layer_ids)

    @property
    def config(self):
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        with_logits: bool = True,
    ) -> TargetOutput:
        """Shape: input_ids (B, T) → hidden states [(B, T, H)] × len(layer_ids), logits (B, T, V)."""
        with capture_layers(self.model, self.layer_ids) as captured:
            if with_logits:
                logits = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                ).logits
            else:
                base = getattr(self.model, self.model.base_model_prefix)
                base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
                logits = None
        return TargetOutput(hidden_states=[captured[i] for i in self.layer_ids], logits=logits)
