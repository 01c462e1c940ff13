"""What the vLLM plugin does, from environment variables or a JSON file; nothing unless configured.

Environment (each overrides the file's key of the same meaning)::

    TRAINER_VLLM_CONFIG=plugin.json    a JSON object with any of the keys below
    TRAINER_VLLM_LOG_DIR=runs/logs     "log_dir":    write verifier log v1 there (step and request records)
    TRAINER_VLLM_LOG_PREFIX=vllm-0     "prefix":     segment name prefix, one per replica (also the "server" field)
    TRAINER_VLLM_TOPK=8                "topk":       top-k width of every verified row, at least 8
    TRAINER_VLLM_WATCH=runs/drafters   "watch":      a publish directory whose drafter versions are hot-loaded
    TRAINER_VLLM_POLL_SECONDS=0.5      "poll_seconds": how often ``watch/current`` is read
    TRAINER_VLLM_GRAFT_LEARN=1         "graft_learn": the graft proposer learns from this server's logits (1/0)

Check a configuration without vLLM: ``python -c "from trainer.integrations.vllm.config import PluginConfig;
print(PluginConfig.from_env())"``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import UserError
from trainer.vlog.schema import MIN_TOPK, PREFIX

ENV = {
    "log_dir": "TRAINER_VLLM_LOG_DIR",
    "prefix": "TRAINER_VLLM_LOG_PREFIX",
    "topk": "TRAINER_VLLM_TOPK",
    "watch": "TRAINER_VLLM_WATCH",
    "poll_seconds": "TRAINER_VLLM_POLL_SECONDS",
    "graft_learn": "TRAINER_VLLM_GRAFT_LEARN",
}
CONFIG_ENV = "TRAINER_VLLM_CONFIG"


class PluginError(RuntimeError):
    """The plugin cannot run against this vLLM (version, executor, scheduling mode); the message says why."""


@dataclass(frozen=True)
class PluginConfig:
    log_dir: Path | None = None
    prefix: str = "vllm"
    topk: int = MIN_TOPK
    watch: Path | None = None
    poll_seconds: float = 0.5
    graft_learn: bool = True

    @property
    def enabled(self) -> bool:
        return self.log_dir is not None or self.watch is not None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PluginConfig:
        """The file named by ``TRAINER_VLLM_CONFIG`` (if any), overridden by the individual variables."""
        env = os.environ if environ is None else environ
        raw: dict[str, object] = {}
        where = {}
        if env.get(CONFIG_ENV):
            path = Path(env[CONFIG_ENV])
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"{CONFIG_ENV}={path}: not a readable JSON file ({e})") from None
            if not isinstance(raw, dict) or set(raw) - set(ENV):
                raise UserError(f"{path}: expected a JSON object with keys among {sorted(ENV)}, got {raw!r:.200}")
            where = {k: str(path) for k in raw}
        for key, name in ENV.items():
            if env.get(name):
                raw[key], where[key] = env[name], name
        return cls._parse(raw, where)

    @classmethod
    def _parse(cls, raw: dict[str, object], where: dict[str, str]) -> PluginConfig:
        def bad(key: str, why: str) -> UserError:
            return UserError(f"{where[key]}: {key} {raw[key]!r:.80} {why}")

        fields: dict[str, object] = {}
        for key in ("log_dir", "watch"):
            if raw.get(key) is not None:
                fields[key] = Path(str(raw[key]))
        if "prefix" in raw:
            if not PREFIX.fullmatch(str(raw["prefix"])):
                raise bad("prefix", "must be letters, digits, '_', '.', '-' (not starting with '.')")
            fields["prefix"] = str(raw["prefix"])
        if "topk" in raw:
            try:
                fields["topk"] = int(str(raw["topk"]))
            except ValueError:
                raise bad("topk", "is not an integer") from None
            if fields["topk"] < MIN_TOPK:
                raise bad("topk", f"is below the verifier log's minimum {MIN_TOPK}")
        if "poll_seconds" in raw:
            try:
                fields["poll_seconds"] = float(str(raw["poll_seconds"]))
            except ValueError:
                raise bad("poll_seconds", "is not a number") from None
            if not fields["poll_seconds"] > 0:
                raise bad("poll_seconds", "must be positive")
        if "graft_learn" in raw:
            value = str(raw["graft_learn"]).strip().lower()
            if value not in ("1", "0", "true", "false"):
                raise bad("graft_learn", "is not one of 1/0/true/false")
            fields["graft_learn"] = value in ("1", "true")
        return cls(**fields)
