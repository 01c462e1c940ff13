"""The graft daemon: verifier logs in, a published adjacency matrix ``M`` (V, k) out.

Run it on CPU next to a log directory (``trainer eval --logs DIR`` writes one)::

    trainer adapt graft --logs runs/logs --publish runs/adjacency --once

Evidence, per record (field names of the verifier log v1, docs/verifier_log.md):

- step record: every verified node (the root and the N draft tokens) is one observation for the row of its
  token: the logged top-k ids with weight ``exp(logprob)`` each;
- request record: ``prefill_topk_ids`` gives the prompt positions' top-k (rank ``r`` weighs
  ``prompt_weight * 2**-r``); without it, every successive pair of ``prompt_ids + output_ids`` is one
  observation of weight ``prompt_weight``.

Aggregation (``trainer/adapt/candidates.py``): a batch is ``batch_records`` consecutive log lines (valid or
not) in the reader's order. Before a batch is applied, the evidence one server adds to one row is capped at
``replica_row_cap`` (scaled down proportionally), so one looping or noisy replica cannot thrash a row; scores
decay with a half-life of ``half_life`` log lines; each row keeps ``candidates`` candidates and publishes the
best ``width``. Shareable traffic feeds the shared table (``rows`` rows, default V); traffic with
``shareable: false`` feeds only its tenant's own table (``tenant_rows`` rows, at most ``max_tenants`` tenants,
least recently active evicted), published as the delta ``tenant-NAME.safetensors``; a private record without a
tenant is counted (``private_untenanted``) and used nowhere.

State (``STATE/state.safetensors``, one file replaced atomically): read offsets per segment, the tables, the
line counter, and the length of ``STATE/quarantine.jsonl``. Order of a commit: quarantine lines appended and
fsynced, then the state file replaced; a snapshot is published only from committed state. A restart truncates
the quarantine file to the committed length and resumes at the committed offsets, so after SIGKILL nothing is
counted twice and, batches being fixed runs of lines and the tables order-independent inside a batch, a
``--once`` run on a fixed log publishes bit-for-bit the matrix an uninterrupted run publishes. While tailing,
an idle log flushes a short batch, so batch boundaries (and with them the per-batch replica cap and, when a
table is full, eviction choices) depend on when lines arrived; a restart still resumes exactly at the last
commit. Decay is counted in lines, not batches, so it does not depend on boundaries.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import chain, islice
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from safetensors import SafetensorError, safe_open
from safetensors.torch import save, save_file

from trainer.adapt.candidates import SCALE, CandidateTable
from trainer.adapt.journal import (
    METRICS,
    QUARANTINE,
    StateError,
    lock_state_dir,
    quarantine,
    run_until_signalled,
    truncate_to,
)
from trainer.errors import UserError
from trainer.io import atomic_path, write_text_atomic
from trainer.paths import project_path
from trainer.snapshots import (
    ADJACENCY,
    ADJACENCY_TENSOR,
    DELTA_ROWS,
    PublishError,
    publish,
    read_current,
    read_manifest,
    tenant_filename,
)
from trainer.vlog.reader import Decoded, Item, LogReader, StepColumns
from trainer.vlog.schema import RecordError
from trainer.vlog.workers import DecodePool, Pending

STATE_FILE = "state.safetensors"
DEFAULT_TARGET = "checkpoints/target_tiny"


@dataclass(frozen=True)
class GraftConfig:
    """Aggregation parameters; see the module docstring for the rule."""

    width: int = 8
    candidates: int = 16
    rows: int | None = None
    tenant_rows: int = 4096
    max_tenants: int = 64
    half_life: float = 200_000.0
    batch_records: int = 1024
    replica_row_cap: float = 8.0
    prompt_weight: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.width <= self.candidates:
            raise UserError(f"need 1 <= width <= candidates, got width {self.width}, candidates {self.candidates}")
        positive = ("tenant_rows", "max_tenants", "half_life", "batch_records", "replica_row_cap")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.rows is not None and self.rows <= 0:
            raise UserError(f"--rows must be > 0, got {self.rows}")
        if self.prompt_weight < 0:
            raise UserError(f"--prompt-weight must be >= 0, got {self.prompt_weight}")


def target_vocab_size(target: str | Path) -> int:
    """``vocab_size`` from a target's ``config.json`` (weights are not loaded)."""
    path = project_path(target) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read the target's vocabulary size from {path}: {e}") from e
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if type(vocab) is not int or vocab <= 0:
        raise UserError(f"{path} has no positive integer vocab_size")
    return vocab


@dataclass
class Evidence:
    """Observations of one batch for one table: ``rows`` (N,), ``cands`` (N, K), ``weights`` (N, K) in
    ``SCALE`` units, ``server`` (N,) index of the server that logged each."""

    rows: torch.Tensor
    cands: torch.Tensor
    weights: torch.Tensor
    server: torch.Tensor

    @property
    def nodes(self) -> int:
        return self.rows.numel()


def _topk_block(blocks: list[list[list]], width: int, dtype: np.dtype) -> torch.Tensor:
    """Records' lists of equally wide rows as one (n, min(k, width)) tensor; ``np.fromiter`` over the chained
    rows is several times faster than ``torch.tensor`` on Python lists."""
    k = len(blocks[0][0])
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(blocks)), dtype=dtype)
    return torch.from_numpy(flat).view(-1, k)[:, :width]


def _pad(t: torch.Tensor, k: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, k - t.shape[1]), value=value) if t.shape[1] < k else t


def step_evidence(steps: StepColumns, servers: np.ndarray, candidates: int) -> Evidence:
    """Every verified node of the step records: its token's row gets the node's logged top-k. ``servers`` (R,)
    is the server index of each record."""
    widths = np.unique(steps.k)
    k = min(candidates, int(widths[-1]))
    # Records may log different k: one block of records per k, padded to the widest.
    members = [np.arange(len(steps))] if widths.size == 1 else [np.flatnonzero(steps.k == w) for w in widths]
    rows, cands, weights, node_servers = [], [], [], []
    for index in members:
        block = steps.select(index)
        width = int(block.k[0])
        ids = torch.from_numpy(block.topk_ids).view(-1, width)[:, :k]
        lp = torch.from_numpy(block.topk_logprobs).view(-1, width)[:, :k]
        rows.append(torch.from_numpy(block.rows))
        cands.append(_pad(ids, k, -1))
        weights.append(_pad(torch.round(lp.exp().clamp(max=1.0) * SCALE).long(), k, 0))
        node_servers.append(torch.from_numpy(np.repeat(servers[index], np.diff(block.start))))
    return Evidence(torch.cat(rows), torch.cat(cands), torch.cat(weights), torch.cat(node_servers))


def request_evidence(records: list[dict], servers: list[int], candidates: int, prompt_weight: float) -> Evidence:
    """Prompt evidence: the logged prefill top-k, else successive pairs of prompt and output."""
    parts: list[Evidence] = []
    unit = round(prompt_weight * SCALE)
    for record, server in zip(records, servers, strict=True):
        prompt = record["prompt_ids"]
        topk = record.get("prefill_topk_ids")
        if topk:
            cands = _topk_block([topk], candidates, np.int64)
            weights = (unit >> torch.arange(cands.shape[1])).expand_as(cands)
            rows = torch.tensor(prompt)
        else:
            sequence = torch.tensor(prompt + record["output_ids"], dtype=torch.int64)
            rows, cands = sequence[:-1], sequence[1:, None]
            weights = torch.full_like(cands, unit)
        parts.append(Evidence(rows, cands, weights, torch.full_like(rows, server)))
    return concat(parts)


def concat(parts: list[Evidence]) -> Evidence:
    """One ``Evidence`` of all ``parts``, candidates padded to the widest."""
    if len(parts) == 1:
        return parts[0]
    k = max(p.cands.shape[1] for p in parts)
    return Evidence(
        torch.cat([p.rows for p in parts]),
        torch.cat([_pad(p.cands, k, -1) for p in parts]),
        torch.cat([_pad(p.weights, k, 0) for p in parts]),
        torch.cat([p.server for p in parts]),
    )


# Largest (server, row) key space that ``cap_per_replica`` counts in a dense table (8 MB of float64); beyond it,
# it groups by sorting.
_DENSE_KEYS = 1 << 20


def cap_per_replica(evidence: Evidence, vocab_size: int, cap: int) -> torch.Tensor:
    """Weights with each (server, row)'s batch total scaled down to at most ``cap``: ``floor(w · cap / total)``."""
    if evidence.nodes == 0:
        return evidence.weights
    key = (evidence.server * vocab_size + evidence.rows).numpy()
    node_total = evidence.weights.sum(1).numpy()
    keys = (int(key.max()) // vocab_size + 1) * vocab_size
    if keys <= _DENSE_KEYS:
        # A dense sum per key costs less than sorting the nodes; float64 sums of these integers are exact.
        total = np.bincount(key, weights=node_total, minlength=keys)[key]
    else:
        groups, inverse = np.unique(key, return_inverse=True)
        total = np.bincount(inverse, weights=node_total, minlength=groups.size)[inverse]
    if not (total > cap).any():
        return evidence.weights
    # Whole rows in float64, uncapped ones divided by ``cap`` (which gives w back): int64 division, row gathers
    # and a select cost several times more. Exact while total < 2**43 (a batch holds at most millions of weights
    # of at most SCALE): w · cap < w · total < 2**53 is exact, the quotient is at most w <= SCALE = 2**10, so
    # rounding moves it by at most 2**-43 < 1/total, the least distance from a non-integer quotient to an integer.
    divisor = torch.from_numpy(np.maximum(total, cap))[:, None]
    return evidence.weights.double().mul_(cap).div_(divisor).floor_().long()


@dataclass
class Tenant:
    table: CandidateTable
    last_tick: int


@dataclass
class Counters:
    lines: int = 0
    records: int = 0
    steps: int = 0
    requests: int = 0
    nodes: int = 0
    quarantined: int = 0
    private_untenanted: int = 0
    tenants_evicted: int = 0
    rows_touched: int = 0


@dataclass
class GraftState:
    """Everything a restart needs; ``tick`` is the number of log lines consumed (valid or quarantined)."""

    vocab_size: int
    config: GraftConfig
    shared: CandidateTable
    tenants: dict[str, Tenant] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    quarantine_bytes: int = 0
    state_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def fresh(cls, vocab_size: int, config: GraftConfig) -> GraftState:
        rows = min(config.rows or vocab_size, vocab_size)
        return cls(vocab_size, config, CandidateTable(vocab_size, rows, config.candidates, config.half_life))

    @property
    def tick(self) -> int:
        return self.counters.lines

    def _new_table(self) -> CandidateTable:
        rows = min(self.config.tenant_rows, self.vocab_size)
        return CandidateTable(self.vocab_size, rows, self.config.candidates, self.config.half_life)

    def tenant(self, name: str) -> CandidateTable:
        """The table of tenant ``name``, made (evicting the least recently active tenant) if needed."""
        if name not in self.tenants:
            if len(self.tenants) >= self.config.max_tenants:
                oldest = min(self.tenants, key=lambda t: (self.tenants[t].last_tick, t))
                del self.tenants[oldest]
                self.counters.tenants_evicted += 1
            self.tenants[name] = Tenant(self._new_table(), self.tick)
        self.tenants[name].last_tick = self.tick
        return self.tenants[name].table

    def apply(self, records: list[dict], lines: int) -> int:
        """Apply one batch of valid ``records`` out of ``lines`` consumed log lines; returns rows touched."""
        steps = StepColumns.from_records([r for r in records if r["kind"] == "step"])
        return self.apply_decoded(steps, [r for r in records if r["kind"] == "request"], lines)

    def apply_decoded(self, steps: StepColumns, requests: list[dict], lines: int) -> int:
        """``apply`` for a batch decoded by ``trainer.vlog.reader.BatchDecoder``: its valid step and request records."""
        self.counters.lines += lines
        self.counters.records += len(steps) + len(requests)
        # Per table (None: the shared one): the indices of its step records, its request records.
        groups: dict[str | None, tuple[list[int], list[dict]]] = {}
        for i, (shareable, tenant) in enumerate(zip(steps.shareable, steps.tenant, strict=True)):
            if shareable:
                groups.setdefault(None, ([], []))[0].append(i)
            elif tenant is None:
                self.counters.private_untenanted += 1
            else:
                groups.setdefault(tenant, ([], []))[0].append(i)
        for record in requests:
            if record["shareable"]:
                groups.setdefault(None, ([], []))[1].append(record)
            elif record["tenant"] is None:
                self.counters.private_untenanted += 1
            else:
                groups.setdefault(record["tenant"], ([], []))[1].append(record)
        touched = 0
        # Sorted, so that tenant creation and eviction inside a batch do not depend on record order.
        for name in sorted(groups, key=lambda n: (n is not None, n or "")):
            table = self.shared if name is None else self.tenant(name)
            index, group_requests = groups[name]
            touched += self._add(table, steps.select(index), group_requests)
        self.counters.rows_touched += touched
        return touched

    def _add(self, table: CandidateTable, steps: StepColumns, requests: list[dict]) -> int:
        names = sorted(set(steps.server) | {r["server"] for r in requests})
        server_ids = {name: i for i, name in enumerate(names)}
        self.counters.steps += len(steps)
        self.counters.requests += len(requests)
        parts = []
        if len(steps):
            servers = np.array([server_ids[s] for s in steps.server], dtype=np.int64)
            parts.append(step_evidence(steps, servers, self.config.candidates))
            self.counters.nodes += parts[-1].nodes
        if requests:
            servers = [server_ids[r["server"]] for r in requests]
            parts.append(request_evidence(requests, servers, self.config.candidates, self.config.prompt_weight))
        evidence = concat(parts)
        weights = cap_per_replica(evidence, self.vocab_size, round(self.config.replica_row_cap * SCALE))
        return table.add(evidence.rows, evidence.cands, weights, self.tick)

    # ------------------------------------------------------------ persistence

    def to_bytes(self) -> bytes:
        tensors = {f"shared/{k}": v for k, v in self.shared.state().items()}
        tenants = []
        for i, (name, tenant) in enumerate(sorted(self.tenants.items())):
            tensors.update({f"tenant{i}/{k}": v for k, v in tenant.table.state().items()})
            tenants.append({"name": name, "last_tick": tenant.last_tick, "dropped": tenant.table.dropped})
        meta = {
            "vocab_size": self.vocab_size,
            "config": asdict(self.config),
            "offsets": self.offsets,
            "counters": asdict(self.counters),
            "quarantine_bytes": self.quarantine_bytes,
            "state_id": self.state_id,
            "shared_dropped": self.shared.dropped,
            "tenants": tenants,
        }
        return save({k: v.contiguous() for k, v in tensors.items()}, metadata={"state": json.dumps(meta)})

    @classmethod
    def from_file(cls, path: Path, vocab_size: int, config: GraftConfig) -> GraftState:
        try:
            with safe_open(path, "pt") as f:
                meta = json.loads(f.metadata()["state"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            built = GraftConfig(**meta["config"])
        except (OSError, SafetensorError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read the daemon state {path}: {e}; move it away to start from scratch") from e
        if meta["vocab_size"] != vocab_size or built != config:
            raise UserError(
                f"the daemon state {path} was built for vocab_size {meta['vocab_size']} with {meta['config']}, "
                f"not vocab_size {vocab_size} with {asdict(config)}; use another --state directory to change them"
            )

        def table(prefix: str, dropped: int) -> CandidateTable:
            part = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + "/")}
            return CandidateTable.from_state(part, vocab_size, config.half_life, dropped)

        state = cls(vocab_size, config, table("shared", meta["shared_dropped"]))
        for i, t in enumerate(meta["tenants"]):
            state.tenants[t["name"]] = Tenant(table(f"tenant{i}", t["dropped"]), t["last_tick"])
        state.offsets = meta["offsets"]
        state.counters = Counters(**meta["counters"])
        state.quarantine_bytes = meta["quarantine_bytes"]
        state.state_id = meta["state_id"]
        return state


def lines_of(batch: list[Item]) -> list[bytes]:
    """The raw lines of a batch of reader items (the reader's own rejections left out)."""
    return [item.record for item in batch if not isinstance(item.record, RecordError)]


class GraftDaemon:
    """Reads ``logs`` from the committed offsets, aggregates, commits state to ``state_dir`` and publishes
    snapshots to ``publish_dir``. ``run`` returns when the log is drained (``once``) or ``stop`` is set."""

    def __init__(
        self,
        logs: Path,
        publish_dir: Path,
        state_dir: Path,
        vocab_size: int,
        config: GraftConfig,
        commit_seconds: float = 5.0,
        publish_seconds: float = 30.0,
        poll_seconds: float = 0.5,
        keep: int = 5,
        console: Console | None = None,
        decode_workers: int = 1,
    ) -> None:
        if not Path(logs).is_dir():
            raise UserError(f"--logs {logs} is not a directory (a server or `trainer eval --logs` writes one)")
        self.logs, self.publish_dir, self.state_dir = Path(logs), Path(publish_dir), Path(state_dir)
        self.commit_seconds, self.publish_seconds, self.poll_seconds = commit_seconds, publish_seconds, poll_seconds
        self.keep = keep
        self.console = console or Console(highlight=False)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the state directory {self.state_dir}: {e.strerror}") from e
        self._lock = lock_state_dir(self.state_dir, "graft")
        path = self.state_dir / STATE_FILE
        self.state = (
            GraftState.from_file(path, vocab_size, config) if path.exists() else GraftState.fresh(vocab_size, config)
        )
        self._truncate_quarantine()
        self.reader = LogReader(self.logs, self.state.offsets, vocab_size=vocab_size, raw=True)
        self.decoder = DecodePool(vocab_size, decode_workers)
        # The workers start while this process sets up and reads; it decodes itself until they are ready.
        self.decoder.start()
        self.stop = threading.Event()
        self.version: int | None = None
        self._started = time.monotonic()
        self._lines_at_start = self.state.counters.lines
        self._nodes_at_start = self.state.counters.nodes

    def close(self) -> None:
        """Stop the decode workers and release the state directory."""
        self.decoder.close()
        self._lock.close()

    def _truncate_quarantine(self) -> None:
        """Drop quarantine lines written after the last commit: the restart reads those log lines again."""
        truncate_to(self.state_dir / QUARANTINE, self.state.quarantine_bytes)

    def _quarantine(self, errors: list[RecordError]) -> None:
        """Append rejected lines durably before the batch is applied (a restart cuts back what was not
        committed, so a failure here loses nothing)."""
        self.state.quarantine_bytes = quarantine(self.state_dir, errors)
        self.state.counters.quarantined += len(errors)

    def step(self, items: list[Item], decoded: Decoded | None = None, offsets: dict[str, int] | None = None) -> int:
        """Apply one batch of reader items (raw lines, or the reader's own rejections), ``decoded`` already when a
        worker decoded it; ``offsets`` are the reader's right after the batch (default: where it is now).
        Returns rows touched."""
        lines = [i for i, item in enumerate(items) if not isinstance(item.record, RecordError)]
        if decoded is None:
            decoded = self.decoder.decode([items[i].record for i in lines])
        # The quarantine keeps the log's order: the reader's rejections and the decoder's, merged by position.
        errors = [(i, item.record) for i, item in enumerate(items) if isinstance(item.record, RecordError)]
        for j, error in decoded.errors:
            item = items[lines[j]]
            errors.append((lines[j], RecordError(error.reason, item.segment, item.start)))
        if errors:
            self._quarantine([error for _, error in sorted(errors, key=lambda e: e[0])])
        touched = self.state.apply_decoded(decoded.steps, decoded.requests, len(items))
        # ``offsets`` is the copy taken when the batch was read.
        self.state.offsets = dict(self.reader.offsets) if offsets is None else offsets
        return touched

    def commit(self) -> None:
        """Replace the state file (offsets, tables, counters together); metrics follow."""
        try:
            with atomic_path(self.state_dir / STATE_FILE) as tmp:
                tmp.write_bytes(self.state.to_bytes())
            self._write_metrics()
            self._report("committed")
        except OSError as e:
            raise StateError(
                f"cannot write the daemon state into {self.state_dir}: {e.strerror}; the previous "
                "commit stands, and a restart resumes from it"
            ) from e

    def _published_tick(self) -> int | None:
        current = read_current(self.publish_dir)
        if current is None:
            return None
        manifest = read_manifest(current[1])
        if manifest.get("state_id") != self.state.state_id:
            return None
        return manifest.get("tick")

    def publish(self) -> int:
        """Publish the committed tables as a new version."""
        state, width = self.state, self.state.config.width

        def payload(directory: Path) -> None:
            save_file({ADJACENCY_TENSOR: state.shared.adjacency(width)}, directory / ADJACENCY)
            for name, tenant in state.tenants.items():
                rows, best = tenant.table.best(width)
                delta = {DELTA_ROWS: rows, ADJACENCY_TENSOR: best.to(torch.int32)}
                save_file(delta, directory / tenant_filename(name))

        manifest = {
            "kind": "graft",
            "vocab_size": state.vocab_size,
            "width": width,
            "tick": state.tick,
            "state_id": state.state_id,
            "config": asdict(state.config),
            "files": state.offsets,
            "tenants": sorted(state.tenants),
            "metrics": self.metrics(),
        }
        self.version = publish(self.publish_dir, payload, manifest, keep=self.keep)
        self._report("published")
        with contextlib.suppress(OSError):  # the next commit writes the metrics again
            self._write_metrics()
        return self.version

    def metrics(self) -> dict:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        c = self.state.counters
        return {
            **asdict(c),
            "records_per_s": (c.lines - self._lines_at_start) / elapsed,
            "nodes_per_s": (c.nodes - self._nodes_at_start) / elapsed,
            "version": self.version,
            "rows_held": self.state.shared.held(),
            "tenants": len(self.state.tenants),
            "dropped_weight": self.state.shared.dropped + sum(t.table.dropped for t in self.state.tenants.values()),
        }

    def _write_metrics(self) -> None:
        write_text_atomic(self.state_dir / METRICS, json.dumps(self.metrics(), indent=1))

    def _report(self, what: str) -> None:
        m = self.metrics()
        self.console.print(
            f"[bold]{what}[/] version {m['version']} · lines {m['lines']} · {m['records_per_s']:.0f} records/s · "
            f"{m['nodes_per_s']:.0f} nodes/s · rows touched {m['rows_touched']} · rows held {m['rows_held']} · "
            f"tenants {m['tenants']} · quarantined {m['quarantined']}"
        )

    def _batches(self) -> Iterator[list[Item]]:
        """Batches of ``batch_records`` lines; a short batch when the log runs dry, then an empty one."""
        size = self.state.config.batch_records
        while True:
            it = iter(self.reader)
            while len(batch := list(islice(it, size))) == size:
                yield batch
            if batch:
                yield batch
            yield []

    def _decoded_batches(self) -> Iterator[tuple[list[Item], Decoded | None, dict[str, int]]]:
        """``_batches`` with each batch's decoding (None: decode it in this process) and the reader's offsets
        after it, in log order. While the log is busy, full batches go to the decode workers, up to
        ``DecodePool.ahead`` in flight, so the workers decode the next batches while this process aggregates; each
        batch read hands one out, so a worker is topped up between any two batches applied here. When the workers
        hold all they may and the oldest result has not arrived, this process decodes the batch it has just read
        rather than wait (with one worker, decoding costs about twice what aggregating does: 30-38 against 16 us a
        line), at most ``DecodePool.ahead`` batches beyond the workers'. A short or empty batch is decoded here once
        all before it are out."""
        ahead: deque = deque()
        size = self.state.config.batch_records
        in_flight = 0

        def oldest_ready() -> bool:
            return not isinstance(ahead[0][1], Pending) or self.decoder.arrived(ahead[0][1])

        def take() -> tuple[list[Item], Decoded | None, dict[str, int]]:
            nonlocal in_flight
            batch, work, offsets = ahead.popleft()
            if isinstance(work, Pending):
                in_flight -= 1
                work = self.decoder.result(work)
            return batch, work, offsets

        for batch in self._batches():
            work = None
            if len(batch) == size:
                while ahead and in_flight >= self.decoder.ahead:
                    if not oldest_ready() and len(ahead) < 2 * self.decoder.ahead:
                        work = self.decoder.decode(lines_of(batch))
                        break
                    yield take()
                if work is None:
                    work = self.decoder.submit(lines_of(batch))
            ahead.append((batch, work, dict(self.reader.offsets)))
            in_flight += isinstance(work, Pending)
            if work is None:
                # A short or empty batch, or no worker to take it (none configured, or still starting): decoded
                # here, after every batch before it.
                while ahead:
                    yield take()
            elif oldest_ready():
                yield take()

    def _prune_offsets(self) -> None:
        """Forget segments removed from the log directory (retention), so the state does not grow forever."""
        present = {n.removesuffix(".part").removesuffix(".jsonl") for n in os.listdir(self.logs)}
        for stem in [s for s in self.reader.offsets if s not in present]:
            del self.reader.offsets[stem]
        self.state.offsets = dict(self.reader.offsets)

    def _attempt(self, action: Callable[[], object], what: str) -> bool:
        """While tailing, a failed commit or publish is reported and retried later; the daemon goes on."""
        try:
            action()
        except (StateError, PublishError) as e:
            self.console.print(f"[bold red]{what} failed:[/] {e}", soft_wrap=True)
            return False
        return True

    def run(self, once: bool) -> int:
        """Process until drained (``once``) or stopped; commit, publish, return 0. While tailing, a failed
        commit or publish is reported and retried; the last ones raise ``StateError`` / ``PublishError``."""
        try:
            needs_publish = self._published_tick() != self.state.tick
        except PublishError:
            needs_publish = True
        last_commit, last_publish = time.monotonic(), float("-inf")
        dirty = False
        for batch, decoded, offsets in self._decoded_batches():
            if batch:
                self.step(batch, decoded, offsets)
                dirty = needs_publish = True
            if self.stop.is_set() or (once and not batch):
                break
            now = time.monotonic()
            if not batch:
                self._prune_offsets()
            if dirty and (not batch or now - last_commit >= self.commit_seconds):
                # A --once run stops at the first failure, with its reason; a tailing one retries later.
                if once:
                    self.commit()
                    dirty = False
                else:
                    dirty = not self._attempt(self.commit, "commit")
                last_commit = now
            if not once and not dirty and needs_publish and now - last_publish >= self.publish_seconds:
                needs_publish = not self._attempt(self.publish, "publish")
                last_publish = now
            if not batch:
                self.stop.wait(self.poll_seconds)
        if dirty:
            self.commit()
        if needs_publish:
            self.publish()
        return 0


def run_graft(
    logs: Path,
    publish_dir: Path,
    target: str | Path = DEFAULT_TARGET,
    state_dir: Path | None = None,
    once: bool = False,
    config: GraftConfig | None = None,
    commit_seconds: float = 5.0,
    publish_seconds: float = 30.0,
    poll_seconds: float = 0.5,
    keep: int = 5,
    decode_workers: int = 1,
) -> int:
    """The ``trainer adapt graft`` command: SIGTERM/SIGINT finish the batch, persist, publish, exit 0."""
    daemon = GraftDaemon(
        logs,
        publish_dir,
        state_dir or Path(publish_dir) / ".state",
        target_vocab_size(target),
        config or GraftConfig(),
        commit_seconds,
        publish_seconds,
        poll_seconds,
        keep,
        decode_workers=decode_workers,
    )
    try:
        return run_until_signalled(daemon.stop, lambda: daemon.run(once))
    finally:
        daemon.close()
