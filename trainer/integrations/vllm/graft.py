"""Graft's table inside vLLM: a ``custom_class`` proposer that drafts chains from the adjacency matrix the graft
daemon publishes, learning online from the target's logits as our recycling session does (docs/vllm.md, "Graft").

vLLM verifies chains only, so each request drafts the chain our engine's ``recycling-chain`` builder drafts: from
the last committed token, each node's best-ranked successor, ``num_speculative_tokens`` deep (shorter where a token
has no known successor). Serve it with the plugin configured (the plugin maps batch rows to requests and hands the
proposer the target's logits; ``TRAINER_VLLM_WATCH`` names the daemon's publish directory, empty until it
publishes)::

    TRAINER_VLLM_WATCH=runs/adjacency TRAINER_VLLM_LOG_DIR=runs/logs .venv-vllm/bin/vllm serve \\
        checkpoints/target_tiny --no-async-scheduling --speculative-config '{"method": "custom_class", \\
        "model": "trainer.integrations.vllm.graft.GraftProposer", "num_speculative_tokens": 8}'

The tables, one :class:`~trainer.decoding.drafting.RecyclingSession` each (so one merge rule with ``trainer serve``
and ``trainer eval --adjacency``: rows learnt here since the last load stay, the published version fills the rest):

- the shared table, which requests without a tenant draft from;
- one per tenant (``vllm_xargs.tenant``; at most :data:`MAX_TENANTS`, the least recently used dropped), loaded
  from the published version with the tenant's delta over the shared rows (``snapshots.load_adjacency``).

Evidence (with ``TRAINER_VLLM_GRAFT_LEARN``, on by default): the top-k of the target's logits at every prompt
position vLLM computes (positions served from vLLM's prefix cache have no hidden states and teach nothing) and at
every verified node. A shareable request's evidence goes to the shared table and its tenant's; a private one's to
its tenant's only, and a private request without a tenant teaches nothing (as the daemon counts it:
``private_untenanted``).

A published version is loaded and checked on a thread of its own; the engine thread switches tables between
steps. A version that cannot be loaded or does not fit the target is refused, counted under phase ``graft`` and
logged once; the tables in use stay. Any other error of the proposer drafts nothing for that step (vLLM decodes
plainly) and is counted the same way: it never raises into vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.decoding.builders import chain_template
from trainer.decoding.drafting import RecyclingSession, check_adjacency
from trainer.decoding.tree import retrieval
from trainer.integrations.vllm.config import PluginConfig, PluginError
from trainer.integrations.vllm.metrics import PluginFigures
from trainer.integrations.vllm.poller import Poller
from trainer.integrations.vllm.records import identity, verified_rows
from trainer.sampling import top_rows
from trainer.snapshots import load_adjacency, read_current, snapshot_kind

# Tenants whose tables one process keeps (each a (V, k) matrix: 9.7 MB at V = 151,936 and k = 8).
MAX_TENANTS = 64
# Width of a table before a version is loaded (the recycling builder's default, TreeOptions.recycling_width).
WIDTH = 8
logger = logging.getLogger("trainer.integrations.vllm")


def _log_error(phase: str, error: Exception) -> None:
    logger.error("trainer plugin: %s failed before the graft proposer was attached (%s: %s)", phase,
                 type(error).__name__, error)  # fmt: skip


@dataclass
class Prepared:
    """A version loaded and checked off the engine thread: the shared matrix and each named tenant's view."""

    version: int
    directory: Path
    tables: dict[str | None, torch.Tensor] = field(default_factory=dict)


class GraftProposer:
    """vLLM's ``custom_class`` proposer (built by vLLM with its ``VllmConfig``); the plugin attaches the runner
    (:meth:`attach`), feeds evidence (:meth:`observe`, :meth:`learn_prompts`) and starts the watch."""

    def __init__(self, vllm_config: Any) -> None:
        config = PluginConfig.from_env()
        if not config.enabled:
            raise PluginError(
                "the graft proposer needs the trainer vLLM plugin: set TRAINER_VLLM_WATCH to the graft daemon's "
                "publish directory (and TRAINER_VLLM_LOG_DIR to log the steps)"
            )
        self.depth = int(vllm_config.speculative_config.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.learns = config.graft_learn
        self.on_error: Callable[[str, Exception], None] = _log_error
        self.shared = RecyclingSession(self.vocab_size, WIDTH)
        self.tenants: OrderedDict[str, RecyclingSession] = OrderedDict()
        self.identities: dict[str, tuple[str | None, bool]] = {}
        self.runner: Any = None
        self.figures: PluginFigures | None = None
        # The published version in use (None: none loaded), and the versions refused.
        self.version: int | None = None
        self.refused: set[int] = set()
        self._ready: Prepared | None = None
        # The shared matrix of the version in use, as published (a new tenant's table starts from it).
        self._published: torch.Tensor | None = None
        # Tenants whose view of the published version the watch thread should load; tenants with a table. Both
        # change on the engine thread and are read on the watch thread, under the lock.
        self._wanted: set[str] = set()
        self._known: set[str] = set()
        self._lock = threading.Lock()
        self._poller: Poller | None = None
        self.watch: Path | None = None
        self.template = chain_template(self.depth)

    def load_model(self, target: Any) -> None:
        """Called by vLLM's CPU runner with the target once the runner is built: the proposer has no model of its
        own, and without the plugin's runner hook it could not tell requests apart."""
        if self.runner is None:
            raise PluginError(
                "the graft proposer was not attached to vLLM's runner: the trainer plugin's hooks are not installed "
                "in this process (is trainer installed in vLLM's environment?)"
            )

    def attach(self, runner: Any, on_error: Callable[[str, Exception], None], figures: PluginFigures) -> None:
        """The plugin's runner hook: the runner whose batch rows the proposer drafts for, where its errors are
        counted, and the figures that show the version in use on vLLM's ``/metrics``."""
        self.runner, self.on_error, self.figures = runner, on_error, figures

    # ---- published versions -----------------------------------------------------------------------------------
    def start_watch(self, watch: Path, poll_seconds: float) -> None:
        """Watch ``watch/current`` for adjacency versions on a thread of its own, from the first drafting step on."""
        self.watch = watch
        self._poller = Poller(self.check_once, poll_seconds, lambda phase, e: self.on_error(phase, e), "graft")

    def close(self) -> None:
        if self._poller is not None:
            self._poller.close()

    def check_once(self) -> None:
        """Load a new version (or the views of tenants met since the last load) for the engine thread to take."""
        assert self.watch is not None
        with self._lock:
            if self._ready is not None:
                return
            wanted, self._wanted, known = self._wanted, set(), set(self._known)
        current = read_current(self.watch)
        if current is None:
            with self._lock:
                self._wanted |= wanted
            return
        version, directory = current
        if version in self.refused:
            return
        new = version != self.version
        tenants = known if new else wanted & known
        if not new and not tenants:
            return
        try:
            if snapshot_kind(directory) != "adjacency":
                raise PluginError(f"{directory} holds a drafter, not an adjacency matrix (graft serves tables)")
            prepared = Prepared(version, directory)
            for tenant in [None, *sorted(tenants)] if new else sorted(tenants):
                table = load_adjacency(directory, tenant)
                check_adjacency(table, self.vocab_size, version)
                prepared.tables[tenant] = table
        except Exception as e:
            if new:
                self.refused.add(version)
            self.on_error("graft", PluginError(f"adjacency version {version} refused ({type(e).__name__}: {e}); "
                                               f"the tables in use stay (version {self.version})"))  # fmt: skip
            return
        with self._lock:
            self._ready = prepared

    def _switch(self) -> None:
        """Between steps (engine thread): take a prepared version into the tables."""
        with self._lock:
            prepared, self._ready = self._ready, None
        if prepared is None:
            return
        if prepared.version != self.version:
            self.shared.set_adjacency(prepared.tables[None], prepared.version)
            self.version, self._published = prepared.version, prepared.tables[None]
            self.figures.set("adjacency_version", prepared.version)
            logger.info("trainer plugin: graft serves adjacency version %d (%s)", prepared.version, prepared.directory)
        for tenant, table in prepared.tables.items():
            if tenant is not None and tenant in self.tenants:
                self.tenants[tenant].set_adjacency(table, prepared.version)

    # ---- tables -------------------------------------------------------------------------------------------------
    def _identity(self, req_id: str) -> tuple[str | None, bool]:
        if req_id not in self.identities:
            self.identities[req_id] = identity(req_id, self.runner.requests[req_id].sampling_params.extra_args)
        return self.identities[req_id]

    def _table(self, tenant: str | None) -> RecyclingSession:
        """The table ``tenant`` drafts from; a new tenant starts from the shared matrix as last loaded (its own
        view of the published version is loaded off the engine thread and merged at a later step)."""
        if tenant is None:
            return self.shared
        table = self.tenants.get(tenant)
        if table is None:
            table = RecyclingSession(self.vocab_size, WIDTH)
            if self._published is not None:
                table.set_adjacency(self._published, self.version)
            self.tenants[tenant] = table
            with self._lock:
                self._known.add(tenant)
                self._wanted.add(tenant)
                if len(self.tenants) > MAX_TENANTS:
                    self._known.discard(self.tenants.popitem(last=False)[0])
        self.tenants.move_to_end(tenant)
        return table

    def _learners(self, req_id: str) -> list[RecyclingSession]:
        """The tables a request's evidence goes to (module docstring)."""
        tenant, shareable = self._identity(req_id)
        tables = [self.shared] if shareable else []
        if tenant is not None:
            tables.append(self._table(tenant))
        return tables

    def forget(self, req_id: str) -> None:
        """A request ended (the plugin's ``_update_states`` hook)."""
        self.identities.pop(req_id, None)

    @property
    def width(self) -> int:
        return max([self.shared.adjacency.shape[1], *(t.adjacency.shape[1] for t in self.tenants.values())])

    # ---- evidence ---------------------------------------------------------------------------------------------
    def top_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """The top ids of every logit row as wide as the widest table, on the host. Shape: (R, V) → (R, width)."""
        return top_rows(logits, self.width)[0].cpu()

    def observe(self, runner: Any, top: torch.Tensor, metadata: Any) -> None:
        """The verified nodes of this step teach their tables; ``top`` (R, width): :meth:`top_ids` of every logit
        row of the batch."""
        if not self.learns:
            return
        for row in verified_rows(runner, metadata):
            tokens = torch.tensor([row.root, *row.drafts.tolist()], dtype=torch.long)
            ids = top[row.first_row : row.first_row + len(tokens)]
            for table in self._learners(row.request):
                table.learn_top(tokens, ids)

    def learn_prompts(self, runner: Any, scheduler_output: Any, hidden_states: torch.Tensor) -> None:
        """The prompt positions this step computed (prefill chunks) teach their tables: the target's logits there
        from ``hidden_states`` (Shape: (T, H), every scheduled token of the batch, in batch order)."""
        if not self.learns:
            return
        starts = runner.query_start_loc.cpu
        for b, req_id in enumerate(runner.input_batch.req_ids):
            state = runner.requests[req_id]
            begin = state.num_computed_tokens
            count = min(scheduler_output.num_scheduled_tokens.get(req_id, 0), state.num_prompt_tokens - begin)
            if count <= 0:
                continue
            tables = self._learners(req_id)
            if not tables:
                continue
            first = int(starts[b])
            top = self.top_ids(runner.model.compute_logits(hidden_states[first : first + count]))
            tokens = torch.tensor(state.prompt_token_ids[begin : begin + count], dtype=torch.long)
            for table in tables:
                table.learn_top(tokens, top)

    # ---- drafting ---------------------------------------------------------------------------------------------
    def propose(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any, slot_mappings: Any = None
    ) -> list[list[int]]:
        """One chain per batch row (``[]`` for a row that sampled nothing: a partial prefill). Fails open: an
        error drafts nothing this step."""
        try:
            if self._poller is not None and not self._poller.started:
                self._poller.start()
            self._switch()
            drafts = []
            for i, sampled in enumerate(sampled_token_ids):
                if not sampled:
                    drafts.append([])
                    continue
                tenant, _ = self._identity(self.runner.input_batch.req_ids[i])
                root = int(token_ids_cpu[i, int(num_tokens_no_spec[i]) - 1])
                tree = retrieval(self._table(tenant).adjacency, root, self.template)
                drafts.append(tree.tokens[1:].tolist())
            return drafts
        except Exception as e:
            self.on_error("graft", e)
            return [[] for _ in sampled_token_ids]
