"""Response regeneration against a config-built 2-layer Qwen3 that uses the project tokenizer and chat template."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from trainer.data.regenerate import generate_batch, read_resume_state, regenerate, stop_tokens
from trainer.data.sources import load_text
from trainer.devices import parse_device
from trainer.errors import UserError

MAX_NEW = 12

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "    return a + b", "reasoning_content": "trivial"},
            {"role": "user", "content": "and subtraction?"},
            {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
        ]
    },
    {"conversations": [{"from": "human", "value": "import os"}, {"from": "gpt", "value": "os.path.join"}]},
    {"not a conversation": True},
    {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "1"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "3"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "a longer question about the standard library and its json module " * 3},
            {"role": "assistant", "content": "json.dumps"},
            {"role": "user", "content": "a trailing user turn stays as it is"},
        ]
    },
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(model_dir: Path, data: Path, out: Path, **kw) -> bytes:
    regenerate(str(model_dir), [str(data)], str(out), max_new_tokens=MAX_NEW, **kw)
    return out.read_bytes()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "checkpoints" / "target_tiny")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).eval()
    # A random model almost never picks one of 8192 tokens; a larger end-of-turn row makes some replies stop on
    # the marker and others run to max_new_tokens, so both endings are exercised.
    with torch.no_grad():
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] *= 5.0
        # Sharper distributions (greedy choices unchanged): near-uniform over 8192 tokens, a draw lands within a
        # float32 rounding of a boundary of the cumulative sum once in a few hundred, and batches of different
        # sizes round the logits differently in their last bits, which flipped a seeded draw in ~1 run of 10.
        model.lm_head.weight *= 20.0
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return path


@pytest.fixture(scope="module")
def greedy(model_dir: Path, chats: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The uninterrupted greedy output at batch size 2."""
    return run(model_dir, chats, tmp_path_factory.mktemp("greedy") / "regen.jsonl", batch_size=2)


def records(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode().splitlines()]


def test_greedy_matches_generate_turn_by_turn(model_dir: Path, chats: Path, greedy: bytes) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(parse_device(None)).eval()
    stops = stop_tokens(tokenizer)
    assert stops.ids == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]

    def reference(history: list[dict]) -> tuple[list[int], bool]:
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
            eos_token_id=stops.ids, pad_token_id=stops.pad_id,
        )[0, ids.shape[1] :].tolist()  # fmt: skip
        cut = next((i for i, t in enumerate(out) if t in stops.ids), None)
        return (out, False) if cut is None else (out[:cut], True)

    out = records(greedy)
    inputs = [c for c in CONVERSATIONS if "not a conversation" not in c]
    assert [r["id"] for r in out] == [f"{chats}:{n}" for n in (1, 2, 3, 5, 6)]
    assert all(r["source"] == r["id"] for r in out)

    # First assistant turns, all in one left-padded batch: the same tokens as one generate call per prompt.
    first_prompts, first_refs = [], []
    for record in out:
        first = next(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")
        history = record["messages"][:first]
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        first_prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        first_refs.append(reference(history))
    assert generate_batch(model, first_prompts, stops, MAX_NEW) == first_refs

    endings = []
    for record, source in zip(out, inputs, strict=True):
        original = source.get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
            for t in source["conversations"]
        ]
        messages = record["messages"]
        assert [m["role"] for m in messages] == [m["role"] for m in original]
        for j, (new, old) in enumerate(zip(messages, original, strict=True)):
            if old["role"] != "assistant":
                assert new == old
                continue
            # Every turn continues the history with the regenerated earlier replies in it.
            ids, stopped = reference(messages[:j])
            endings.append(stopped)
            assert set(new) == {"role", "content"}
            assert new["content"] == tokenizer.decode(ids, skip_special_tokens=False)
            assert "<|im_end|>" not in new["content"]
            assert new["content"] != old["content"]
    assert any(endings) and not all(endings), "the test model should both stop on the marker and hit the cap"


def test_batch_size_does_not_change_greedy_output(model_dir: Path, chats: Path, greedy: bytes, tmp_path: Path) -> None:
    assert run(model_dir, chats, tmp_path / "bs1.jsonl", batch_size=1) == greedy
    assert run(model_dir, chats, tmp_path / "bs3.jsonl", batch_size=3) == greedy


def test_resume_after_torn_write(model_dir: Path, chats: Path, greedy: bytes, tmp_path: Path) -> None:
    lines = greedy.splitlines(keepends=True)
    out = tmp_path / "regen.jsonl"
    out.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    assert run(model_dir, chats, out, batch_size=3) == greedy
    ids = [r["id"] for r in records(out.read_bytes())]
    assert len(ids) == len(set(ids)) == 5

    # A last line that ends in a newline but does not parse is dropped as well.
    out.write_bytes(lines[0] + b'{"id": "chats\n')
    assert read_resume_state(out).done == {records(lines[0])[0]["id"]}
    assert out.read_bytes() == lines[0]
    assert run(model_dir, chats, out, batch_size=2) == greedy

    # Everything done: nothing is generated and the file is unchanged.
    assert run(model_dir, chats, out, batch_size=2) == greedy

    # Damage before the last line is not ours to cut away.
    out.write_bytes(lines[0] + b"garbage\n" + lines[1])
    with pytest.raises(UserError, match="line 2"):
        run(model_dir, chats, out)


KILLED_RUN = """
import sys, time
import trainer.data.regenerate as r
generate = r.generate_batch

def slow(*args, **kwargs):
    time.sleep(0.3)  # leaves time to kill the run between its writes
    return generate(*args, **kwargs)

r.generate_batch = slow
r.regenerate(sys.argv[1], [sys.argv[2]], sys.argv[3], max_new_tokens=int(sys.argv[4]), batch_size=1)
"""


@pytest.mark.slow
def test_resume_after_sigkill(model_dir: Path, chats: Path, greedy: bytes, tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", KILLED_RUN, str(model_dir), str(chats), str(out), str(MAX_NEW)]
    log = tmp_path / "stderr.txt"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            assert proc.poll() is None, f"the run ended before it could be killed:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the run wrote nothing in 120 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert 2 <= out.read_bytes().count(b"\n") < 5
    assert run(model_dir, chats, out, batch_size=2) == greedy


def test_sampling_is_seeded(model_dir: Path, chats: Path, greedy: bytes, tmp_path: Path) -> None:
    sampled = run(model_dir, chats, tmp_path / "a.jsonl", temperature=1.0, top_p=0.9, seed=7, batch_size=2)
    # Each turn samples from its own stream, so neither the batch nor an interruption changes the draws.
    assert run(model_dir, chats, tmp_path / "b.jsonl", temperature=1.0, top_p=0.9, seed=7, batch_size=3) == sampled
    resumed = tmp_path / "c.jsonl"
    resumed.write_bytes(b"".join(sampled.splitlines(keepends=True)[:3]))
    assert run(model_dir, chats, resumed, temperature=1.0, top_p=0.9, seed=7, batch_size=1) == sampled

    assert sampled != greedy
    assert any(a != b for a, b in zip(records(sampled), records(greedy), strict=True))
    assert run(model_dir, chats, tmp_path / "d.jsonl", temperature=1.0, top_p=0.9, seed=8, batch_size=2) != sampled


def test_user_errors(model_dir: Path, chats: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no_such_target"
    with pytest.raises(UserError, match="no_such_target"):
        regenerate(str(missing), [str(chats)], str(tmp_path / "out.jsonl"))
    with pytest.raises(UserError, match="no_such_data"):
        regenerate(str(model_dir), [str(tmp_path / "no_such_data.jsonl")], str(tmp_path / "out.jsonl"))
    with pytest.raises(UserError, match="temperature"):
        regenerate(str(model_dir), [str(chats)], str(tmp_path / "out.jsonl"), temperature=-1.0)
    with pytest.raises(UserError, match="inside the input"):
        regenerate(str(model_dir), [str(chats.parent)], str(chats.parent / "regen.jsonl"))


def test_regeneration_on_the_shipped_tiny_target(chats: Path, tmp_path: Path) -> None:
    target = ROOT / "checkpoints" / "target_tiny"
    out = run(target, chats, tmp_path / "tiny.jsonl", batch_size=3)
    rows = records(out)
    assert len(rows) == 5
    originals = [c for c in CONVERSATIONS if "messages" in c or "conversations" in c]
    for row, original in zip(rows, originals, strict=True):
        turns = original.get("messages") or original["conversations"]
        assert len(row["messages"]) == len(turns)
        for new, old in zip(row["messages"], turns, strict=True):
            if new["role"] != "assistant":
                assert new["content"] == old.get("content", old.get("value"))
            else:
                assert "<|im_end|>" not in new["content"]
    assert any(m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant")


def test_chat_template_kwargs_reach_the_prompt(model_dir: Path) -> None:
    from trainer.data.regenerate import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    history = [{"role": "user", "content": "hi"}]
    on = tokenizer.decode(prompt_ids(tokenizer, history))
    off = tokenizer.decode(prompt_ids(tokenizer, history, enable_thinking=False))
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_text_windows_are_continued_and_read_back_as_text(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.py").write_text("import os\n\n\ndef main():\n    return os.getcwd()\n" * 6)
    (docs / "b.py").write_text("x = 1\n")  # shorter than one prompt: no window
    prompt_tokens, new = 8, 6
    out = tmp_path / "regen.jsonl"
    regenerate(str(model_dir), [str(docs)], str(out), max_new_tokens=new, format="text", prompt_tokens=prompt_tokens)
    rows = records(out.read_bytes())
    ids = tokenizer((docs / "a.py").read_text(), add_special_tokens=False)["input_ids"]
    # Windows of prompt + continuation tokens tile the document; each starts with its slice of it.
    offsets = list(range(0, len(ids) - prompt_tokens + 1, prompt_tokens + new))
    assert [r["id"] for r in rows] == [f"{docs / 'a.py'}@{o}" for o in offsets]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for row, offset in zip(rows, offsets, strict=True):
        prompt = ids[offset : offset + prompt_tokens]
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0].tolist()
        reply = greedy[prompt_tokens:]
        if tokenizer.eos_token_id in reply:
            reply = reply[: reply.index(tokenizer.eos_token_id)]
        assert row["text"] == tokenizer.decode(prompt + reply)
    # Training reads the file as text (a line without one is skipped); --limit spreads the windows it keeps.
    with out.open("a") as f:
        f.write(json.dumps({"id": "x", "no_text": 1}) + "\n")
    texts = load_text([str(out)])
    assert [t["text"] for t in texts] == [r["text"] for r in rows]
    limited = tmp_path / "limited.jsonl"
    regenerate(str(model_dir), [str(docs)], str(limited), max_new_tokens=new, format="text", prompt_tokens=8, limit=2)
    assert [r["id"] for r in records(limited.read_bytes())] == [rows[0]["id"], rows[len(rows) // 2]["id"]]


# --engine vllm, as far as it goes without vLLM: the choice on the command line, the refusal that says how to get
# vLLM's environment, the hand-over to that environment's python (here a stand-in script), and the context check a
# vLLM engine brings. tests/test_vllm_data.py runs the engine itself in vLLM's environment.


def test_engine_choice_is_on_the_command_line(capsys) -> None:
    from trainer.data.cli import main as data_main

    for command in ("regenerate", "cache"):
        with pytest.raises(SystemExit):
            data_main([command, "--help"])
        text = capsys.readouterr().out
        assert "--engine {hf,vllm}" in text and "default: hf" in text.split("--engine {hf,vllm}", 2)[2]
        assert "--vllm_python" in text


def test_vllm_engine_without_vllm_says_how(model_dir: Path, chats: Path, tmp_path: Path, monkeypatch) -> None:
    import trainer.data.vllm_engine as engines

    monkeypatch.setattr(engines, "vllm_importable", lambda: False)
    monkeypatch.delenv("TRAINER_VLLM_PYTHON", raising=False)
    out = tmp_path / "out.jsonl"
    with pytest.raises(UserError, match=r"TRAINER_VLLM_PYTHON.*\.ci/vllm_env"):
        regenerate(str(model_dir), [str(chats)], str(out), engine="vllm")
    with pytest.raises(UserError, match="no_such_python"):
        regenerate(str(model_dir), [str(chats)], str(out), engine="vllm", vllm_python=str(tmp_path / "no_such_python"))
    with pytest.raises(UserError, match="--device cpu is for --engine hf"):
        regenerate(str(model_dir), [str(chats)], str(out), engine="vllm", device="cpu")
    assert not out.exists()


STAND_IN = """#!{python}
import json, os, sys, time
names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONPATH")
record = {{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in names}}, "pid": os.getpid()}}
with open({record!r}, "w") as f:
    json.dump(record, f)
time.sleep(float(os.environ.get("STAND_IN_SLEEP", "0")))
sys.exit(int(os.environ.get("STAND_IN_EXIT", "0")))
"""


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that plays vLLM's python: it records its arguments, environment and pid."""
    record = tmp_path / "record.json"
    script = tmp_path / "vllm_python"
    script.write_text(STAND_IN.format(python=sys.executable, record=str(record)))
    script.chmod(0o755)
    return script, record


def test_vllm_engine_runs_the_job_in_vllm_python(model_dir: Path, chats: Path, tmp_path: Path, monkeypatch) -> None:
    import trainer.data.vllm_engine as engines

    monkeypatch.setattr(engines, "vllm_importable", lambda: False)
    python, record = stand_in(tmp_path)
    monkeypatch.setenv("TRAINER_VLLM_PYTHON", str(python))
    out = tmp_path / "out.jsonl"
    regenerate(str(model_dir), [str(chats)], str(out), temperature=0.5, seed=3, max_new_tokens=7, engine="vllm",
               chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    seen = json.loads(record.read_text())
    assert seen["argv"][:3] == ["-m", "trainer.data.vllm_main", "regenerate"]
    arguments = json.loads(seen["argv"][3])
    assert arguments["data"] == [str(chats)] and arguments["output"] == str(out)
    assert (arguments["temperature"], arguments["seed"], arguments["max_new_tokens"]) == (0.5, 3, 7)
    assert arguments["chat_template_kwargs"] == {"enable_thinking": False}
    # The child runs the engine in process (no second hand-over) and this checkout's code.
    assert arguments["engine"] == "vllm" and arguments["vllm_python"] is None
    assert seen["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    # The child's failure is the command's, with its exit code.
    monkeypatch.setenv("STAND_IN_EXIT", "3")
    with pytest.raises(UserError, match="exit code 3"):
        regenerate(str(model_dir), [str(chats)], str(out), engine="vllm")


HANDING_OVER = """
import sys
from trainer.data.vllm_engine import run_in_vllm_env
run_in_vllm_env("regenerate", {}, sys.argv[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_command_takes_vllms_process_with_it(tmp_path: Path) -> None:
    python, record = stand_in(tmp_path)
    env = {**os.environ, "STAND_IN_SLEEP": "60", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    parent = subprocess.Popen([sys.executable, "-c", HANDING_OVER, str(python)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not record.exists() or not record.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.02)
        time.sleep(0.1)  # the record is written before the stand-in sleeps
        child = json.loads(record.read_text())["pid"]
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and "zombie" not in _state(child):
            assert time.monotonic() < deadline, "vLLM's process outlived the killed command: it could race a rerun"
            time.sleep(0.02)
    finally:
        parent.kill()
        parent.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "gone"


def test_a_prompt_longer_than_the_engine_context_is_named(model_dir: Path, chats: Path, tmp_path: Path, monkeypatch):
    import trainer.data.regenerate as r
    import trainer.data.vllm_engine as engines

    # The vLLM branch with the HF model behind it, and a context as small as a vLLM engine might report.
    model, _ = r.load_target(str(model_dir), torch.float32, torch.device("cpu"))
    monkeypatch.setattr(engines, "vllm_importable", lambda: True)
    monkeypatch.setattr(r, "vllm_engine", lambda target, dtype: r.Engine(r.hf_engine(model).generate, context=40))
    out = tmp_path / "out.jsonl"
    too_long = (
        rf"{chats}:1 \(assistant turn 0\): a prompt of \d+ tokens plus max_new_tokens=30 exceeds the target's context"
    )
    with pytest.raises(UserError, match=too_long + " of 40 tokens"):
        regenerate(str(model_dir), [str(chats)], str(out), max_new_tokens=30, engine="vllm")
    # Within the context, the vLLM branch writes what the HF engine writes.
    monkeypatch.setattr(r, "vllm_engine", lambda target, dtype: r.Engine(r.hf_engine(model).generate, context=4096))
    regenerate(str(model_dir), [str(chats)], str(out), max_new_tokens=MAX_NEW, batch_size=2, engine="vllm")
    hf_out = tmp_path / "hf.jsonl"
    regenerate(str(model_dir), [str(chats)], str(hf_out), max_new_tokens=MAX_NEW, batch_size=2)
    assert out.read_bytes() == hf_out.read_bytes()
