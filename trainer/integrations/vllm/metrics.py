"""The plugin's figures on vLLM's ``/metrics``: hot reloads, the plugin's own errors, whether its hooks run.

vLLM's OpenAI server answers ``/metrics`` from its API server process's prometheus registry, while the plugin's
hooks run in other processes (the engine core's scheduler, the worker's runner). So each process that runs hooks
keeps its figures in a small JSON file of its own (``figures-PID.json`` in one directory, replaced whole when a
figure changes), and the API server process registers a collector that reads and adds up the directory's files at
each scrape. The directory's path travels in ``TRAINER_VLLM_METRICS_DIR``: the first process that loads the plugin
(the API server, before it starts the engine) sets it, and vLLM's processes inherit it. Exposed::

    trainer_vllm_drafter_swaps_total        published versions swapped into the served drafter
    trainer_vllm_drafter_refused_total      published versions refused (unloadable or of another architecture)
    trainer_vllm_drafter_version            the version serving (0: the drafter vLLM started with)
    trainer_vllm_errors_total{phase}        errors the plugin caught in its hooks, by phase (nothing reached vLLM)
    trainer_vllm_hooks_active               1 once the first verification step ran through the plugin's hooks

With ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM serves a multiprocess registry of its own and these lines are absent.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainer.io import write_text_atomic

DIR_ENV = "TRAINER_VLLM_METRICS_DIR"
# name in the files -> (metric name, kind, help); counters add up across processes, gauges take the largest.
FIGURES = {
    "swaps": ("trainer_vllm_drafter_swaps", "counter", "Published drafter versions swapped into vLLM"),
    "refused": ("trainer_vllm_drafter_refused", "counter", "Published drafter versions refused (unloadable or "
                "mismatched); the old weights keep serving"),
    "version": ("trainer_vllm_drafter_version", "gauge", "Drafter version serving (0: the one vLLM started with)"),
    "adjacency_version": ("trainer_vllm_adjacency_version", "gauge", "Adjacency version the graft proposer serves "
                          "(0: none published yet)"),
    "hooks_active": ("trainer_vllm_hooks_active", "gauge", "1 once a verification step ran through the plugin's "
                     "hooks"),
}  # fmt: skip
ERRORS = ("trainer_vllm_errors", "Errors the trainer plugin caught in its hooks (vLLM kept serving), by phase")
# Error counts change every step while a fault lasts; their file is rewritten at most this often.
ERROR_WRITE_SECONDS = 1.0


class PluginFigures:
    """One process's figures, written to ``directory/figures-PID.json``: at once on a swap, a refusal or the
    self-check, at most every :data:`ERROR_WRITE_SECONDS` for errors. Writing never raises (a full disk must
    not turn a counted error into a raised one)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / f"figures-{os.getpid()}.json"
        self.values = dict.fromkeys(FIGURES, 0)
        self.errors: Counter[str] = Counter()
        self._written = 0.0
        self._dirty = False
        self.write()

    def add(self, name: str) -> None:
        self.values[name] += 1
        self.write()

    def set(self, name: str, value: int) -> None:
        self.values[name] = value
        self.write()

    def error(self, phase: str) -> None:
        self.errors[phase] += 1
        self._dirty = True
        if time.monotonic() - self._written >= ERROR_WRITE_SECONDS:
            self.write()

    def flush(self) -> None:
        """Write error counts held back by the rate limit."""
        if self._dirty:
            self.write()

    def write(self) -> None:
        self._written, self._dirty = time.monotonic(), False
        try:
            write_text_atomic(self.path, json.dumps({**self.values, "errors": dict(self.errors)}))
        except OSError:
            self._dirty = True


class DirectoryCollector:
    """A prometheus collector of the figures other processes write to ``directory`` (zeros until they have)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def collect(self) -> Iterator[Metric]:
        files = []
        for path in sorted(self.directory.glob("figures-*.json")):
            try:
                files.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # replaced while read, or torn by a full disk: skip this scrape
                continue
        for key, (name, kind, text) in FIGURES.items():
            values = [float(f.get(key, 0)) for f in files] or [0.0]
            if kind == "counter":
                yield CounterMetricFamily(name, text, value=sum(values))
            else:
                yield GaugeMetricFamily(name, text, value=max(values))
        errors = CounterMetricFamily(*ERRORS, labels=["phase"])
        total: Counter[str] = Counter()
        for f in files:
            total.update({str(k): int(v) for k, v in dict(f.get("errors", {})).items()})
        for phase, count in sorted(total.items()):
            errors.add_metric([phase], count)
        yield errors


def figures_dir() -> Path:
    """This vLLM server's figures directory. The first caller in a process tree creates it, exports its path to
    the processes vLLM starts after, and registers its collector with the process's prometheus registry."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    path = Path(tempfile.mkdtemp(prefix="trainer-vllm-"))
    os.environ[DIR_ENV] = str(path)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    REGISTRY.register(DirectoryCollector(path))
    return path
