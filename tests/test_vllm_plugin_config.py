"""The vLLM plugin's configuration, without vLLM: off unless configured, clear errors on bad settings.

PYTHONPATH=$PWD python -m pytest tests/test_vllm_plugin_config.py -q
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.errors import UserError
from trainer.integrations.vllm import dflash_cpu, register, specblock, treeflash
from trainer.integrations.vllm.config import PluginConfig
from trainer.integrations.vllm.records import ended_output


def test_unconfigured_the_plugin_only_registers_its_drafters(monkeypatch):
    for name in ("TRAINER_VLLM_CONFIG", "TRAINER_VLLM_LOG_DIR", "TRAINER_VLLM_WATCH"):
        monkeypatch.delenv(name, raising=False)
    assert not PluginConfig.from_env().enabled
    monkeypatch.delitem(sys.modules, "trainer.integrations.vllm.hooks", raising=False)
    # The drafters' registrations (they need vLLM, absent here) always run; nothing else does.
    registered = []
    monkeypatch.setattr(specblock, "install", lambda: registered.append("specblock"))
    monkeypatch.setattr(treeflash, "install", lambda: registered.append("treeflash"))
    monkeypatch.setattr(dflash_cpu, "install", lambda: registered.append("dflash_cpu"))
    register()  # would import vLLM (absent here, or patch it there) if it installed the hooks
    assert sorted(registered) == ["dflash_cpu", "specblock", "treeflash"]
    assert "trainer.integrations.vllm.hooks" not in sys.modules


def test_variables_override_the_file(tmp_path):
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps({"log_dir": "a", "prefix": "replica-1", "topk": 16}))
    config = PluginConfig.from_env({"TRAINER_VLLM_CONFIG": str(path), "TRAINER_VLLM_LOG_DIR": "b"})
    assert (config.log_dir, config.prefix, config.topk, config.enabled) == (Path("b"), "replica-1", 16, True)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TRAINER_VLLM_TOPK": "4"}, "TRAINER_VLLM_TOPK: topk '4' is below the verifier log's minimum 8"),
        ({"TRAINER_VLLM_TOPK": "x"}, "TRAINER_VLLM_TOPK: topk 'x' is not an integer"),
        ({"TRAINER_VLLM_LOG_PREFIX": ".hidden"}, "TRAINER_VLLM_LOG_PREFIX: prefix '.hidden' must be"),
        ({"TRAINER_VLLM_POLL_SECONDS": "0"}, "poll_seconds '0' must be positive"),
    ],
)
def test_a_bad_setting_names_its_variable(env, message):
    with pytest.raises(UserError) as error:
        PluginConfig.from_env(env)
    assert message in str(error.value)


def test_a_bad_file_names_itself(tmp_path):
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps({"log_dri": "a"}))
    with pytest.raises(UserError, match=f"{path}: expected a JSON object with keys among"):
        PluginConfig.from_env({"TRAINER_VLLM_CONFIG": str(path)})
    path.write_text("{")
    with pytest.raises(UserError, match="not a readable JSON file"):
        PluginConfig.from_env({"TRAINER_VLLM_CONFIG": str(path)})


def test_export_check_without_vllms_environment_says_how_and_writes_nothing(tmp_path, monkeypatch):
    from trainer.export.cli import main

    monkeypatch.delenv("TRAINER_VLLM_PYTHON", raising=False)
    out = tmp_path / "export"
    with pytest.raises(UserError, match=r"--check vllm needs vLLM's python .*\.ci/vllm_env"):
        main(["checkpoints/eagle3_tiny", "--format", "speculators", "--out", str(out), "--check", "vllm"])
    assert not out.exists()


def params(max_tokens=8, min_tokens=0, eos=2, ignore_eos=False, stop_token_ids=()):
    return SimpleNamespace(max_tokens=max_tokens, min_tokens=min_tokens, eos_token_id=eos, ignore_eos=ignore_eos,
                           stop_token_ids=list(stop_token_ids))  # fmt: skip


@pytest.mark.parametrize(
    ("output", "p", "ended"),
    [
        ([5, 6, 7], params(), None),  # goes on
        ([5, 6, 2], params(), [5, 6, 2]),  # EOS as the step's last token
        ([5, 2, 6, 7], params(), [5, 2]),  # EOS among the step's accepted tokens: cut after it
        ([5, 2, 6], params(min_tokens=3), None),  # EOS before min_tokens does not stop
        ([5, 2, 6], params(ignore_eos=True), None),
        ([5, 9, 6], params(stop_token_ids=[9]), [5, 9]),
        (list(range(10, 20)), params(max_tokens=8), list(range(10, 18))),  # past the length limit: cut
        (list(range(10, 18)), params(max_tokens=8), list(range(10, 18))),  # exactly at it
    ],
)
def test_the_worker_tells_which_step_ended_a_request(output, p, ended):
    """Where vLLM's worker has a process of its own it hears of a finished request a step late: the plugin writes
    the request record on the step that ended it (length or stop token), with the output the scheduler keeps."""
    assert ended_output(output, p) == ended
