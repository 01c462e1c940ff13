"""The plugin's hot-reload figures on vLLM's ``/metrics``: versions swapped in, versions refused, the version serving.

vLLM's OpenAI server answers ``/metrics`` from its API server process's prometheus registry, while the drafter runs
in another process (the engine core, or its worker). So the process that runs the drafter keeps the figures in a
small JSON file, replaced whole when one changes (rare: a swap or a refusal), and the API server process registers
a collector that reads that file at each scrape. The file's path travels in ``TRAINER_VLLM_METRICS_FILE``: the
first process that loads the plugin (the API server, before it starts the engine) sets it, and vLLM's processes
inherit it. Exposed::

    trainer_vllm_drafter_swaps_total     published versions swapped into the served drafter
    trainer_vllm_drafter_refused_total   published versions refused (unloadable or of another architecture)
    trainer_vllm_drafter_version         the version serving (0: the drafter vLLM started with)

With ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM serves a multiprocess registry of its own and these lines are absent.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainer.io import write_text_atomic

FILE_ENV = "TRAINER_VLLM_METRICS_FILE"
# name in the file -> (metric name, kind, help)
FIGURES = {
    "swaps": ("trainer_vllm_drafter_swaps", "counter", "Published drafter versions swapped into vLLM"),
    "refused": ("trainer_vllm_drafter_refused", "counter", "Published drafter versions refused (unloadable or "
                "mismatched); the old weights keep serving"),
    "version": ("trainer_vllm_drafter_version", "gauge", "Drafter version serving (0: the one vLLM started with)"),
}  # fmt: skip


class DrafterFigures:
    """The figures, kept by the process that runs the drafter and written to ``path`` on every change."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.values = dict.fromkeys(FIGURES, 0)
        self._write()

    def add(self, name: str) -> None:
        self.values[name] += 1
        self._write()

    def set(self, name: str, value: int) -> None:
        self.values[name] = value
        self._write()

    def _write(self) -> None:
        write_text_atomic(self.path, json.dumps(self.values))


class FileCollector:
    """A prometheus collector of the figures another process writes to ``path`` (zeros until it has)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def collect(self) -> Iterator[Metric]:
        try:
            values = json.loads(self.path.read_text())
        except (OSError, ValueError):
            values = {}
        for key, (name, kind, text) in FIGURES.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, text, value=float(values.get(key, 0)))


def figures_file() -> Path:
    """The figures' file of this vLLM server. The first caller in a process tree creates it, exports its path to
    the processes vLLM starts after, and registers its collector with the process's prometheus registry."""
    if os.environ.get(FILE_ENV):
        return Path(os.environ[FILE_ENV])
    handle, name = tempfile.mkstemp(prefix="trainer-vllm-", suffix=".json")
    os.close(handle)
    path = Path(name)
    os.environ[FILE_ENV] = name
    atexit.register(path.unlink, missing_ok=True)
    REGISTRY.register(FileCollector(path))
    return path
