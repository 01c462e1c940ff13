"""A background thread that calls one check every ``poll_seconds`` inside vLLM's process, failing open.

The drafter reloader (:mod:`trainer.integrations.vllm.reload`) and the graft proposer
(:mod:`trainer.integrations.vllm.graft`) each watch a publish directory with one. An exception of the check is
handed to ``on_error(phase, error)`` and the thread goes on. The thread is stopped and joined before the
interpreter finalises: a daemon thread frozen inside a load at exit aborted vLLM's process (``terminate called
without an active exception``)::

    python -c "from trainer.integrations.vllm.poller import Poller; import time; \\
        p = Poller(lambda: print('check'), 0.1, lambda phase, e: None, 'demo'); p.start(); time.sleep(0.35); p.close()"
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable


class Poller:
    def __init__(
        self, check: Callable[[], None], poll_seconds: float, on_error: Callable[[str, Exception], None], phase: str
    ) -> None:
        self.check, self.poll_seconds, self.on_error, self.phase = check, poll_seconds, on_error, phase
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"trainer-vllm-{self.phase}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the thread, waiting for a check in progress."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check()
            except Exception as e:  # the thread outlives anything a publish directory can do to it
                self.on_error(self.phase, e)
