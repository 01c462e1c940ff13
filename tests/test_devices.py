"""``--device`` and ``--dtype``: one parser (trainer/devices.py) behind ``trainer eval``, ``trainer serve``,
``trainer adapt bandit`` and ``trainer data regenerate``, with the same messages everywhere; bf16 weights where
``--dtype bfloat16`` asks for them, on CPU."""

import pytest
import torch
from conftest import ROOT, TINY_TARGET

from trainer.adapt.cli import bandit_parser
from trainer.cli import main
from trainer.decoding.batch import BatchEngine
from trainer.decoding.controller import policy_for
from trainer.devices import parse_device, parse_dtype
from trainer.drafters import load_drafter
from trainer.errors import UserError
from trainer.serve.cli import load_models
from trainer.serve.cli import parser as serve_parser
from trainer.serve.metrics import Metrics
from trainer.serve.worker import Worker
from trainer.snapshots import publish

DFLASH_TINY = ROOT / "checkpoints" / "dflash_tiny"


def test_parse_device_and_dtype():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    for text, message in [
        ("gpu0", "--device 'gpu0' is not a device (cpu, cuda or cuda:N)"),
        ("meta", "--device 'meta': only cpu and cuda devices are supported"),
    ]:
        with pytest.raises(UserError) as e:
            parse_device(text)
        assert str(e.value) == message
    with pytest.raises(UserError) as e:
        parse_device("cuda:99")
    assert "--device 'cuda:99'" in str(e.value)
    with pytest.raises(UserError) as e:
        parse_dtype("float33")
    assert str(e.value) == "--dtype 'float33' is not one of float32, bfloat16, float16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(UserError) as e:
        parse_device("cuda")
    assert str(e.value) == "--device 'cuda': CUDA is not available on this machine"


COMMANDS = {
    "eval": [
        "eval",
        "--drafter",
        str(DFLASH_TINY),
        "--target",
        str(TINY_TARGET),
        "--prompts",
        "none.jsonl",
        "--out",
        "o",
    ],
    "serve": ["serve"],
    "adapt bandit": ["adapt", "bandit", "--logs", "logs", "--drafter", str(DFLASH_TINY), "--publish", "pub"],
    "data regenerate": [
        "data",
        "regenerate",
        "--target",
        str(TINY_TARGET),
        "--data",
        "chat.jsonl",
        "--output",
        "o.jsonl",
    ],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "gpu0"], "--device 'gpu0' is not a device (cpu, cuda or cuda:N)"),
        (["--dtype", "float33"], "--dtype 'float33' is not one of float32, bfloat16, float16"),
    ],
)
def test_every_command_refuses_a_bad_device_or_dtype_alike(command, flags, message, capsys, tmp_path, monkeypatch):
    """The same one-line error naming the flag, exit 2, before any model loads or anything is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*COMMANDS[command], *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_flags_parse_on_serve_and_bandit():
    args = serve_parser().parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    assert (args.device, args.dtype) == ("cpu", "bfloat16")
    args = bandit_parser().parse_args(["--logs", "l", "--drafter", "d", "--publish", "p", "--device", "cpu",
                                       "--dtype", "float16"])  # fmt: skip
    assert (args.device, args.dtype) == ("cpu", "float16")
    # Unset: the first GPU when there is one, float32.
    args = serve_parser().parse_args([])
    assert parse_device(args.device) == parse_device(None) and parse_dtype(args.dtype) is torch.float32


def test_serve_loads_bfloat16_weights_and_reloads_drafters_in_them(tmp_path):
    """``trainer serve --dtype bfloat16`` runs the target and the drafter in bf16, and a drafter published later
    (float32 on disk) joins in bf16 too."""
    args = serve_parser().parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    target, drafter = load_models(args)
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16} == {p.dtype for p in drafter.parameters()}
    policy, trees = policy_for("ddtree", 4, "ddtree")
    engine = BatchEngine(target, drafter, trees, policy)
    published = load_drafter(DFLASH_TINY, torch.float32)
    publish(tmp_path / "pub", published.save_pretrained, {"kind": "drafter"})
    worker = Worker(engine, Metrics(), "s", "dflash_tiny", "ddtree", watch=(tmp_path / "pub",))
    worker.reload()
    assert engine.drafter_version == 1 and engine.drafter is not drafter
    assert {p.dtype for p in engine.drafter.parameters()} == {torch.bfloat16}


def test_the_bandit_refuses_float16(capsys, tmp_path, monkeypatch):
    """Its candidates train under autocast in the given dtype: float16 without a loss scaler would underflow."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*COMMANDS["adapt bandit"], "--dtype", "float16"])
    assert exc.value.code == 2
    assert "--dtype 'float16'" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
