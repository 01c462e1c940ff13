"""The engine thread: steps the batch, reloads published snapshots between steps, writes verifier logs.

Requests are submitted from the server's event loop and get their tokens back through their ``on_tokens``
callback (called on this thread). A snapshot directory named by ``--watch`` is looked at every
``reload_seconds``: a new version holding an adjacency matrix replaces the recycling adjacency, one holding a
drafter replaces the drafter for requests that join afterwards (``trainer.snapshots.snapshot_kind`` tells
them apart). A version that fails to load is counted as quarantined and the old one stays in use.

A step record names the drafter and the version that drafted it: the version a request was admitted with (its
sessions stay the ones that drafter made, whatever is published later), and null for both on a drafter-free
step (plain decoding, recycling); a step that read the shared adjacency (recycling, Graft) carries the
adjacency version in use as ``adjacency_version``. A failed prefill or step ends the requests it touched with an
error (``BatchRequest.error``), counted in ``trainer_engine_errors_total{phase}``, apart from quarantined
snapshots. On CPU::

    python -c "from trainer.serve.worker import Worker; help(Worker)"
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.decoding.batch import BatchEngine, BatchRequest, RowStep
from trainer.decoding.builders import BUILDERS
from trainer.decoding.controller import Controller
from trainer.decoding.drafting import GraftSession, RecyclingSession
from trainer.drafters import load_drafter
from trainer.serve.metrics import Metrics
from trainer.snapshots import load_adjacency, read_current, snapshot_kind
from trainer.vlog.recorder import StepRecorder
from trainer.vlog.schema import MIN_TOPK
from trainer.vlog.writer import LogWriter

LOG = logging.getLogger("trainer.serve")


@dataclass
class Identity:
    """Who a request is, for its verifier-log records."""

    request: str
    tenant: str | None
    shareable: bool = True


@dataclass
class Watched:
    directory: Path
    # The version in use (0: none yet) and the newest version that failed to load.
    version: int = 0
    failed: int = 0


class Worker:
    """Owns a :class:`BatchEngine` and the thread that steps it."""

    def __init__(
        self,
        engine: BatchEngine,
        metrics: Metrics,
        server: str,
        drafter_name: str | None,
        neural_tree: str | None,
        writer: LogWriter | None = None,
        watch: tuple[Path, ...] = (),
        reload_seconds: float = 0.5,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.server = server
        self.drafter_name = drafter_name
        self.neural_tree = neural_tree
        # The published adjacency version in use (None: none loaded yet).
        self.adjacency_version: int | None = None
        self.writer = writer
        self.watched = [Watched(Path(d)) for d in watch]
        self.reload_seconds = reload_seconds
        self.identities: dict[int, Identity] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._last_reload = 0.0
        if isinstance(engine.policy, Controller):
            metrics.watch_taus(engine.policy.taus)
        engine.on_failure = self._on_failure
        if writer is not None:
            engine.on_step = self._on_step
            engine.step_topk = MIN_TOPK
            # Request records carry the prompt's top-k: the graft daemon's evidence for prompt positions.
            engine.prefill_topk = MIN_TOPK

    def start(self) -> None:
        self.reload()
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)
        if self.writer is not None:
            self.writer.close()

    def submit(self, request: BatchRequest, identity: Identity) -> None:
        """Queue ``request``; thread-safe. Its request record is written when it finishes."""
        self.identities[id(request)] = identity
        on_tokens = request.on_tokens

        def finish_aware(tokens: list[int], done: bool) -> None:
            if done:
                self._on_finish(request)
            if on_tokens is not None:
                on_tokens(tokens, done)

        request.on_tokens = finish_aware
        self.metrics.requests.labels("submitted").inc()
        self.engine.submit(request)
        self.wake.set()

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            if time.monotonic() - self._last_reload >= self.reload_seconds:
                self.reload()
            self.metrics.queue_depth.set(self.engine.pending.qsize())
            start = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as e:  # the engine ends a failed prefill's or step's requests itself; this is the rest
                self.engine.abort("bookkeeping", e)
                continue
            self.metrics.batch_size.set(len(self.engine.rows))
            if not events:
                self.wake.wait(self.reload_seconds)
                self.wake.clear()
                continue
            self.metrics.observe_step(events, time.perf_counter() - start)

    def _on_failure(self, phase: str, requests: list, error: BaseException) -> None:
        LOG.error("engine %s failed; %d requests end with an error", phase, len(requests), exc_info=error)
        self.metrics.engine_errors.labels(phase).inc()

    def _recorder(
        self, identity: Identity, drafter: str | None, version: int | None, adjacency: int | None = None
    ) -> StepRecorder:
        return StepRecorder(
            self.writer,
            server=self.server,
            request=identity.request,
            tenant=identity.tenant,
            shareable=identity.shareable,
            drafter=drafter,
            drafter_version=version,
            adjacency_version=adjacency,
        )

    def _on_step(self, row: RowStep) -> None:
        # Versions change between steps (hot reload), so each step gets its recorder. The drafter's version is
        # the request's own (its sessions were made by the drafter of that version), never the one loaded now.
        neural = row.event.builder == self.neural_tree
        drafter = self.drafter_name if neural else None
        version = row.request.drafter_version if neural else None
        reads_adjacency = BUILDERS[row.event.builder].session in (RecyclingSession, GraftSession)
        adjacency = self.adjacency_version if reads_adjacency else None
        try:
            self._recorder(self.identities[id(row.request)], drafter, version, adjacency)(row.event)
        except Exception as e:  # a log that cannot take a record must not end the batch's requests
            self._log_failed(e)

    def _on_finish(self, request: BatchRequest) -> None:
        identity = self.identities.pop(id(request))
        self.metrics.requests.labels(request.finish_reason or "unknown").inc()
        if self.writer is None:
            return
        try:
            recorder = self._recorder(identity, None, None)
            recorder.finish(request.prompt.tolist(), list(request.tokens), request.prefill_topk)
        except Exception as e:  # the client still gets its end (the caller delivers it after this returns)
            self._log_failed(e)

    def _log_failed(self, error: Exception) -> None:
        LOG.error("verifier log: a record could not be written", exc_info=error)
        self.metrics.engine_errors.labels("log").inc()

    def reload(self) -> None:
        """Load the newest version of every watched directory that changed; a failure keeps the old one."""
        self._last_reload = time.monotonic()
        for watched in self.watched:
            try:
                current = read_current(watched.directory)
            except Exception as e:  # a torn or foreign pointer file must not stop serving
                self._quarantine(watched, watched.failed, f"{watched.directory}: {e}")
                continue
            if current is None:
                continue
            version, path = current
            if version in (watched.version, watched.failed):
                continue
            try:
                self._load(path, version)
            except Exception as e:  # any failure to load keeps the old version; /metrics shows it
                watched.failed = version
                self._quarantine(watched, version, f"{path}: {type(e).__name__}: {e}")
                continue
            watched.version = version

    def _quarantine(self, watched: Watched, version: int, reason: str) -> None:
        LOG.warning("snapshot quarantined (the version in use stays): %s", reason)
        self.metrics.quarantined.inc()
        self.metrics.last_reload_error.info({"directory": str(watched.directory), "reason": reason[:500]})

    def _load(self, path: Path, version: int) -> None:
        if snapshot_kind(path) == "adjacency":
            self.engine.set_adjacency(load_adjacency(path), version)
            self.adjacency_version = version
            self.metrics.adjacency_version.set(version)
        else:
            drafter = load_drafter(path, self.engine.dtype).to(self.engine.device)
            self.engine.set_drafter(drafter, version)
            self.metrics.drafter_version.set(version)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def seeded_generator(seed: int | None) -> torch.Generator:
    """The request's sampling generator: its ``seed``, or a fresh random one."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
