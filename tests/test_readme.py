"""Every command line of the README's shell blocks runs as written, from a directory outside the checkout.

Long jobs get tiny settings appended (a later option wins): ``fit`` / ``validate`` stop after resolving the
recipe (``--print_config``), which checks the recipe, every override and its type; the data and eval
commands run for real on a few conversations, prompts and tokens; the serving block runs in order against
real servers, its daemons making one pass. Training itself is run from an installed wheel by
``.ci/wheel_check``.
"""

import json
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from conftest import ROOT

from trainer.cli import main
from trainer.serve.process import ServerProcess
from trainer.snapshots import read_current

README = (ROOT / "README.md").read_text()


def readme_blocks() -> list[list[str]]:
    """The command lines of each of the README's ``bash`` blocks: continuations joined, comments, a trailing
    ``&`` (a daemon started in the background) and ``&&`` split off."""
    blocks = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", README, flags=re.S | re.M):
        commands = []
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[-1:] == ["&"]:
                words = words[:-1]
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                command = words[:cut]
                while command and re.fullmatch(r"[A-Z_]+=\S*", command[0]):  # OMP_NUM_THREADS=1 ...
                    command = command[1:]
                commands.append(shlex.join(command))
                words = words[cut + 1 :]
        blocks.append(commands)
    return blocks


BLOCKS = readme_blocks()
COMMANDS = [c for block in BLOCKS for c in block]
# The serving walk-through: a server, a request to it, a server with logs and hot reload, the daemons beside it.
SERVING = next(block for block in BLOCKS if block[0].startswith("trainer serve"))
TINY = {
    "fit": ["--print_config"],
    "validate": ["--print_config"],
    "regenerate": ["--max_new_tokens", "4"],
    "cache": ["--batch_size", "8"],
    "eval": ["--limit", "2", "--max-new-tokens", "4", "--no-greedy-beside"],
    "adapt": ["--once"],
    "export": [],
}


def test_the_readme_test_command_is_what_ci_runs():
    blocks = re.findall(r"^ *```bash\n(.*?)^ *```", README, flags=re.S | re.M)
    tests = [line for block in blocks for line in block.splitlines() if line.endswith("&& pytest")]
    assert len(tests) == 1
    assert f"{tests[0]} || exit 1" in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A working directory outside the checkout with what the README's commands read: ``chat.jsonl`` (20
    short conversations) and a TreeFlash run ``runs/treeflash_tiny`` over the shipped backbone."""
    from trainer.drafters.treeflash import TreeFlashDraftModel

    root = tmp_path_factory.mktemp("readme")
    user, assistant = "Write f{}.", "def f{}(): ..."
    rows = [[{"role": "user", "content": user.format(i)}, {"role": "assistant", "content": assistant.format(i)}]
            for i in range(20)]  # fmt: skip
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    version = root / "runs" / "treeflash_tiny" / "lightning_logs" / "version_0"
    TreeFlashDraftModel.from_dflash(str(ROOT / "checkpoints" / "dflash_tiny")).save_pretrained(version / "hf")
    recipe = {"model": {"init_args": {"target": "checkpoints/target_tiny"}}}
    (version / "config.yaml").write_text(yaml.safe_dump(recipe))
    # Verifier-log directories of the graft commands (the README's eval --logs fills the first one).
    for logs in ("runs/eval/treeflash_tiny/logs", "runs/logs"):
        (root / logs).mkdir(parents=True, exist_ok=True)
    return root


def run_trainer(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return e.code or 0
    return 0


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.split()[-1] != "pytest" and c.startswith("trainer ") and c not in SERVING]
)
def test_readme_trainer_command(command, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    argv = shlex.split(command)[1:]
    job = argv[1] if argv[0] == "data" else argv[0]
    assert run_trainer([*argv, *TINY[job]]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    if job in ("fit", "validate"):
        config = yaml.safe_load(out)
        if "--trainer.max_steps" in argv:
            assert config["trainer"]["max_steps"] == int(argv[argv.index("--trainer.max_steps") + 1])
        if "spec" in config["data"]["init_args"]:
            assert config["data"]["init_args"]["spec"]["tokenizer"] == "checkpoints/target_tiny"
    elif job == "regenerate":
        regenerated = (workdir / "regen.jsonl").read_text().splitlines()
        assert len(regenerated) == 20 and json.loads(regenerated[0])["id"].startswith("chat.jsonl:")
    elif job == "adapt":
        assert read_current(workdir / argv[argv.index("--publish") + 1]) is not None
    elif job == "export":
        out_dir = workdir / argv[argv.index("--out") + 1]
        config = json.loads((out_dir / "config.json").read_text())
        assert config["auto_map"] and (out_dir / "model.safetensors").is_file()
    elif job == "cache":
        manifest = json.loads((workdir / "data" / "cache" / "feat" / "manifest.json").read_text())
        assert manifest["complete"] and manifest["config"]["layers"] == [1, 4, 7]
    else:
        out_dir = next(argv[i + 1] for i, a in enumerate(argv) if a == "--out")
        summary = json.loads((workdir / out_dir / "summary.json").read_text())
        assert summary["n_prompts"] == 2 and all(r["tau"] >= 1 for t in summary["conditions"].values()
                                                 for b in t["runs"].values() for r in b.values())  # fmt: skip


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("python -m trainer.")])
def test_readme_module_command_parses(command, monkeypatch, capsys):
    """The rebuild steps of the tiny target write into checkpoints/; here they only show their arguments."""
    argv = shlex.split(command)
    monkeypatch.setattr(sys, "argv", [argv[2], *argv[3:], "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module(argv[2], run_name="__main__")
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.slow
def test_readme_serving_walkthrough(workdir, monkeypatch, capsys):
    """The serving block in order, for real: each ``trainer serve`` line starts a server (on a free port, not
    8000) and the ``curl`` line asks it for a completion (the logging server too, so its log has a request);
    the daemons beside the logging server make one pass over its log (``--once``), and the server then decodes
    with the adjacency and drafter versions they published."""
    monkeypatch.chdir(workdir)
    curl = shutil.which("curl")
    assert curl, "the README's serving block uses curl: install it (apt-get install curl)"
    request = shlex.split(next(c for c in SERVING if c.startswith("curl ")))

    def ask(server: ServerProcess) -> None:
        url = server.url.removeprefix("http://")
        done = subprocess.run([curl, *(a.replace("localhost:8000", url) for a in request[1:])],
                              capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        assert json.loads(done.stdout)["choices"][0]["text"]

    servers = []
    try:
        for command in SERVING:
            argv = shlex.split(command)
            if argv[:2] == ["trainer", "serve"]:
                if servers:
                    servers[-1].stop()
                servers.append(ServerProcess(argv[2:]))
                if len(servers) > 1:
                    ask(servers[-1])
            elif argv[0] == "curl":
                ask(servers[-1])
            else:
                assert argv[:2] == ["trainer", "adapt"], command
                before = bandit_requests(workdir)
                assert run_trainer([*argv[1:], *TINY["adapt"]]) == 0, capsys.readouterr()
                if argv[2] == "graft":
                    assert "lines 0 " not in capsys.readouterr().out, "the graft daemon read none of the log"
                else:
                    assert bandit_requests(workdir) > before, "the bandit daemon read no request of the log"
        published = [read_current(workdir / d)[0] for d in ("runs/adjacency", "runs/drafters")]
        deadline = time.time() + 60
        while servers[-1].metrics("trainer_adjacency_version", "trainer_drafter_version") != published:
            assert time.time() < deadline, (published, servers[-1].output[-20:])
            time.sleep(0.5)
        ask(servers[-1])  # decoding with what the daemons published
        assert "trainer_engine_errors_total{" not in httpx.get(f"{servers[-1].url}/metrics", timeout=30).text
    finally:
        for server in servers:
            server.stop()
    assert sorted((workdir / "runs" / "logs").glob("*.jsonl")), "the logging server finished no segment"


def bandit_requests(workdir) -> int:
    """Requests the README's bandit daemon has read (its state under its --publish directory; 0 before any)."""
    state = workdir / "runs" / "drafters" / ".state" / "state.json"
    return json.loads(state.read_text())["requests"] if state.is_file() else 0


def test_every_readme_command_is_covered():
    """Every README command is one the tests above run (or the install lines CI runs); adding another kind
    means deciding how it is checked."""
    kinds = ("trainer ", "python -m trainer.", "pip install ")
    # The serving walk-through runs its one curl line; every other line is a trainer command.
    assert [c for c in SERVING if not c.startswith("trainer ")] == [SERVING[1]] and SERVING[1].startswith("curl ")
    assert [c for c in COMMANDS if not c.startswith(kinds) and c not in (SERVING[1], "pytest")] == []
    assert {c.split()[0] if c.startswith("trainer ") else c for c in COMMANDS} >= {"trainer", "pytest"}
