"""vLLM's side of a served SpecBlock drafter (vllm 0.32.0's V1 runner): the model class vLLM's registry and loader
build from a ``--format specblock`` export, and the proposer that drafts SpecBlock's chain with it.

vLLM imports this module itself (its model registry, and the ``EagleProposer`` construction that
:func:`trainer.integrations.vllm.specblock.install` routes here); the plugin never imports it at registration.

SpecBlock's context holds K keys per position, which no vLLM attention backend offers, so the drafter keeps its
own cache per request: :class:`SpecBlockProposer` holds one :class:`~trainer.decoding.drafting.SpecBlockSession`
per request id (row ``i`` of the batch is ``runner.input_batch.req_ids[i]``), fed each step with the tokens vLLM
committed and their target features (the EAGLE-3 auxiliary hidden states vLLM captured at the export's
``eagle_aux_hidden_state_layer_ids``), and drafts every request's chain at once with
:func:`~trainer.decoding.drafting.specblock_chains`, the chain our engine's ``specblock-chain`` builder drafts: one
drafter forward per block of K tokens for the whole batch (the first also enters the step's context). A session is
dropped when its request leaves the runner. Failing open: a drafter error drafts nothing for the requests it
touched from then on (their context is lost), counted and logged once; it never raises into vLLM. Start-up refusals
(prefix caching, M-RoPE, layer ids that do not match the drafter) raise before vLLM serves.

Drafting statistics of a running engine, in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or not::

    llm.collective_rpc(drafter_stats)   # [{"steps": ..., "calls": ..., "forwards": ..., "errors": ..., ...}]
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.spec_decode.eagle import EagleProposer

from trainer.decoding.drafting import SpecBlockSession, specblock_chains
from trainer.drafters.specblock import SpecBlockDraftModel
from trainer.export.speculators import vllm_aux_layer_ids
from trainer.integrations.vllm.config import PluginError

logger = logging.getLogger("trainer.integrations.vllm")


class SpecBlockForVllm(nn.Module):
    """A SpecBlock drafter as vLLM builds and loads it: our :class:`SpecBlockDraftModel` from the export's config
    (``drafter``), its weights from the export's safetensors by their own names. vLLM never runs it as a model:
    :class:`SpecBlockProposer` drafts with ``drafter``."""

    # Its parameters are plain torch tensors: hot reload copies a version in with ``load_weights``
    # (trainer.integrations.vllm.reload), not with vLLM's layerwise reload, which rebuilds vLLM layers' kernels.
    loads_in_place = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        # vLLM's EAGLE-3 route wraps the export's own config in an EAGLEConfig, as ``model``.
        self.drafter = SpecBlockDraftModel(getattr(hf_config, "model", hf_config)).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the export's tensors in (converted to the drafter's dtype); the names loaded, as vLLM checks them."""
        state = dict(weights)
        self.drafter.load_state_dict(state, strict=True)
        return {f"drafter.{name}" for name in state}


class _TargetOutputs:
    """What a :class:`SpecBlockSession` reads of the target, from vLLM's model: the input embedding of token ids
    and, for a drafter without its own head, the LM head's logits (vLLM's ``compute_logits``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def get_input_embeddings(self) -> Any:
        return self.model.embed_input_ids

    def get_output_embeddings(self) -> Any:
        return self.model.compute_logits


class SpecBlockProposer(EagleProposer):
    """vLLM's EAGLE-3 proposer interface over SpecBlock sessions, one per request (module docstring). ``propose``
    returns each request's chain of ``num_speculative_tokens`` target ids (an empty list: no drafts this step)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        if vllm_config.cache_config.enable_prefix_caching:
            raise PluginError(
                "a SpecBlock drafter keeps each request's context itself, and a prefix vLLM serves from its prefix "
                "cache has no target features for it: start vLLM with --no-enable-prefix-caching "
                "(enable_prefix_caching=False)"
            )
        if self.uses_mrope or self.supports_mm_inputs:
            raise PluginError("a SpecBlock drafter drafts for text-only targets with 1-D positions")
        self.runner = runner
        self.sessions: dict[str, SpecBlockSession] = {}
        # Requests served without drafts until they end: their context never fully reached the drafter.
        self.undrafted: set[str] = set()
        self.target: _TargetOutputs | None = None
        # Request-steps drafted, proposer calls that drafted and their drafter forwards (a call only entering
        # prefill chunks drafts nothing), failed drafting steps, and requests whose context steps vLLM ran without
        # the proposer.
        self.steps = 0
        self.calls = 0
        self.forwards = 0
        self.errors = 0
        self.lost = 0
        self._reported: set[str] = set()

    # ---- start-up ----------------------------------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        """Build and load the drafter with vLLM's loader; refuse target layers vLLM would not capture as ours."""
        from vllm.model_executor.model_loader import get_model

        self.model = get_model(vllm_config=self.vllm_config, model_config=self.draft_model_config)
        drafter = self.model.drafter
        expected = vllm_aux_layer_ids(drafter.target_layer_ids)
        configured = getattr(self.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None)
        if configured is None or list(configured) != expected:
            raise PluginError(
                f"{self.draft_model_config.model}: eagle_aux_hidden_state_layer_ids {configured} are not the "
                f"drafter's target layers {drafter.target_layer_ids} in vLLM's convention ({expected}); serve an "
                "export written by `trainer export --format specblock`"
            )
        if expected != sorted(set(expected)):
            # vLLM captures the layers sorted and once each; the drafter reads them in its own order.
            raise PluginError(f"the drafter reads target layers {drafter.target_layer_ids}: vLLM hands auxiliary "
                              "hidden states over in increasing layer order, once each")  # fmt: skip
        self.target = _TargetOutputs(target_model)

    def dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        """Nothing to warm up or capture: the drafter runs eagerly, outside vLLM's forward context."""

    def initialize_cudagraph_keys(self, cudagraph_mode: Any) -> None:
        """No CUDA graphs: the drafter runs eagerly."""

    def validate_same_kv_cache_group(self, kv_cache_config: Any) -> None:
        """No drafter layers in vLLM's KV cache."""

    def initialize_attn_backend(self, kv_cache_config: Any, kernel_block_sizes: list[int] | None = None) -> None:
        """No drafter layers in vLLM's KV cache. The runner hands the proposer the attention metadata of the KV
        cache group it names: group 0, the target's, whose query layout is all ``propose`` reads."""
        self.kv_cache_gid = 0
        self.draft_attn_groups = []

    # ---- every step ----------------------------------------------------------------------------------------------
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Each request's chain. Shapes: target_token_ids, target_positions (T,) the step's scheduled tokens, request
        by request (``common_attn_metadata.query_start_loc_cpu``), of which each request's last
        ``num_rejected_tokens_gpu`` were rejected drafts; target_hidden_states (T, 3H) their auxiliary hidden
        states; next_token_ids (B,) each request's root (the bonus token, or the next prompt token of a request
        still in prefill, which drafts nothing)."""
        self._last_draft_probs = None
        rows = common_attn_metadata.num_reqs
        try:
            req_ids = self.runner.input_batch.req_ids[:rows]
            for gone in set(self.sessions) - set(self.runner.requests):
                del self.sessions[gone]
            self.undrafted &= set(self.runner.requests)
            starts = common_attn_metadata.query_start_loc_cpu[: rows + 1].tolist()
            positions = target_positions.tolist()
            tokens = target_token_ids.tolist()
            roots = next_token_ids.tolist()
            rejected = [0] * rows if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:rows].tolist()
            discarded = self.runner.discard_request_mask.cpu[:rows].tolist()
        except Exception as e:  # failing open: any request with a session may have missed this step's tokens
            self._failed(e, list(self.sessions))
            return [[] for _ in range(rows)]
        drafts: list[list[int]] = [[] for _ in range(rows)]
        fed: list[tuple[int, SpecBlockSession]] = []
        for i, req_id in enumerate(req_ids):
            valid = slice(starts[i], starts[i + 1] - rejected[i])
            try:
                session = self._feed(req_id, tokens[valid], target_hidden_states[valid], positions[valid.start])
            except Exception as e:  # failing open: this request drafts nothing from now on
                self._failed(e, [req_id])
                continue
            if session is not None:
                fed.append((i, session))
        if not fed:
            return drafts
        sessions = [session for _, session in fed]
        lengths = [0 if discarded[i] else num_speculative_tokens for i, _ in fed]
        before = [session.forwards for session in sessions]
        try:
            chains = specblock_chains(sessions, [roots[i] for i, _ in fed], lengths)
        except Exception as e:  # failing open: these requests' sessions may have taken part of the step
            self._failed(e, [req_ids[i] for i, _ in fed])
            return drafts
        for (i, _), chain in zip(fed, chains, strict=True):
            drafts[i] = chain
        if any(lengths):
            self.calls += 1
            self.steps += sum(map(bool, lengths))
            # The longest chain takes part in every forward of the call.
            self.forwards += max(s.forwards - f for s, f in zip(sessions, before, strict=True))
        return drafts

    def _failed(self, error: Exception, req_ids: list[str]) -> None:
        """Count a failed drafting step and serve ``req_ids`` without drafts from now on (their sessions may have
        taken part of the step)."""
        self.errors += 1
        for req_id in req_ids:
            self.sessions.pop(req_id, None)
            self.undrafted.add(req_id)
        self._report("draft", f"drafting failed ({type(error).__name__}: {error}); requests {req_ids[:4]} and any "
                     "other whose drafting fails are served without drafts")  # fmt: skip

    def _feed(self, req_id: str, tokens: list[int], features: torch.Tensor, first: int) -> SpecBlockSession | None:
        """Hand one request's committed tokens (at positions ``first``..) and features to its session; None when the
        request is served without drafts."""
        if req_id in self.undrafted:
            return None
        session = self.sessions.get(req_id)
        if session is None or first != len(session.tokens):
            self.sessions.pop(req_id, None)
            if first != 0:
                # The context before ``first`` never reached the drafter: vLLM ran steps without calling the
                # proposer (near max_model_len).
                self.lost += 1
                self.undrafted.add(req_id)
                self._report("context", f"request {req_id}'s context before position {first} never reached the "
                             "drafter; it (and any other such request) is served without drafts")  # fmt: skip
                return None
            assert self.target is not None
            session = self.sessions[req_id] = SpecBlockSession(self.model.drafter, self.target)
        # SpecBlockSession.commit reads the committed tokens and their features only.
        session.commit(tokens, features, None, None)
        return session

    def _report(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            logger.error("trainer plugin: SpecBlock: %s", message)

    def stats(self) -> dict[str, int]:
        """Request-steps drafted, proposer calls that drafted and their drafter forwards (each over the call's
        requests), failed drafting steps, requests whose context was lost."""
        return {"steps": self.steps, "calls": self.calls, "forwards": self.forwards, "errors": self.errors,
                "lost": self.lost}  # fmt: skip


def drafter_stats(worker: Any) -> dict[str, int] | None:
    """For ``LLM.collective_rpc``: the served SpecBlock proposer's :meth:`SpecBlockProposer.stats` (None: vLLM
    serves no SpecBlock drafter)."""
    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter.stats() if isinstance(drafter, SpecBlockProposer) else None
