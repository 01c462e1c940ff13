"""``trainer serve`` as a subprocess on a free loopback port, for tests, benchmarks and the closed-loop demo.

    python -c "from trainer.serve.process import ServerProcess; s = ServerProcess(['--tree', 'none']); \\
        print(s.url, s.metric('trainer_batch_size')); s.stop()"
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

# The directory that holds this `trainer` package: the subprocess imports the same code.
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
_CODE = "import sys; from trainer.serve.cli import main; main(sys.argv[1:])"


def python_process(code: str, args: list[str], log: Path | None = None) -> subprocess.Popen:
    """``python -c code args`` importing this checkout, one thread, offline; output piped, or appended to
    ``log`` (for a long-running process whose output nobody reads: a full pipe would block its writes)."""
    env = {**os.environ, "PYTHONPATH": str(_PACKAGE_PARENT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", code, *args]
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    with open(log, "a") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


class ServerProcess:
    """Starts ``trainer serve --port 0 ARGS`` and waits until it listens; ``output`` collects what it prints."""

    def __init__(self, args: list[str]) -> None:
        self.process = python_process(_CODE, ["--port", "0", *args])
        self.output: list[str] = []
        for line in self.process.stdout:
            self.output.append(line)
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise RuntimeError("trainer serve did not start:\n" + "".join(self.output[-40:]))
        # Keep draining the output so the server never blocks on a full pipe.
        threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True).start()

    def metric(self, name: str) -> float:
        """The value of a metric line of ``/metrics`` (summed over its exact label set)."""
        return self.metrics(name)[0]

    def metrics(self, *names: str) -> list[float]:
        """The values of several metric lines from one scrape of ``/metrics``."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return [sum(float(v) for v in re.findall(rf"^{re.escape(n)} (\S+)$", text, re.MULTILINE)) for n in names]

    def stop(self) -> None:
        """SIGTERM: the server finishes its requests and its verifier-log segment, then exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
