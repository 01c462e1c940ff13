"""``trainer data regenerate|cache --engine vllm`` against the HF engine on the shipped tiny target (fp32), in vLLM's
own environment (marker ``vllm``; ``.ci/run`` runs ``tests/test_vllm*.py`` there, the default suite does not). Both
engines run in this process: vLLM's engine is built once per configuration and shared (one for generation, one for
features), plus one vLLM run in a subprocess that the resume test kills::

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -m vllm -q -p no:cacheprovider \\
        tests/test_vllm_data.py

How sampled output is compared (the engines draw from different random streams, so only distributions can agree):
- the first token of one prompt, sampled under 400 seeds by each engine, against the exact nucleus distribution of
  the target at that temperature and top_p (Pearson chi-square, p > 1e-3 for each engine);
- over 64 stdlib windows sampled by each engine, three per-reply statistics: length, distinct-token rate and the
  mean log-prob of the generated tokens under the target (at temperature 1). Each engine's mean must lie within 4
  standard errors of the other's (|z| < 4, a false alarm about once in 16 000 runs per statistic); the same test
  between two HF runs at temperatures 0.7 and 1.0 must fail, so it can see a wrong temperature.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import ROOT, TINY_TARGET, chi2_pvalue, copy_stdlib

from trainer.data.cache import FeatureCache, cache_features
from trainer.data.features import online_features, with_features
from trainer.data.pack import collate
from trainer.data.prepare import DataSpec
from trainer.data.regenerate import (
    generate_batch,
    load_target,
    prompt_ids,
    regenerate,
    stop_tokens,
    text_stops,
    turn_seed,
)
from trainer.data.vllm_engine import VllmFeatures, VllmGenerator, close_shared_llm
from trainer.sampling import nucleus
from trainer.target import Target
from trainer.tiny.corpus import list_modules
from trainer.training.datamodule import DraftData

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW = 32
TEMPERATURE, TOP_P = 0.7, 0.95
LAYERS, TOPK = [1, 4, 7], 8

CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "and subtraction?"},
        {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
    ],
    [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "os.path.join"}],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "3"},
    ],
    [{"role": "user", "content": "def f(x):\n    return x"}, {"role": "assistant", "content": "f"}],
    [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": "serialises"}],
    [
        {"role": "user", "content": "class Stack:"},
        {"role": "assistant", "content": "def push(self, x):"},
        {"role": "user", "content": "and pop"},
        {"role": "assistant", "content": "def pop(self):"},
    ],
    [{"role": "user", "content": "Write a function that adds two numbers."}, {"role": "assistant", "content": "+"}],
]


@pytest.fixture(scope="module", autouse=True)
def vllm_settings():
    """A 1 GiB KV cache (vLLM's CPU build would otherwise size it from the machine's free memory); on leaving, the
    shared engine is shut down and vLLM's variables restored, for the next test module of the same run."""
    names = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
    close_shared_llm()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def hf():
    """The tiny target in fp32 as the HF engine loads it, and its tokenizer."""
    return load_target(str(TINY_TARGET), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def vllm_generator() -> VllmGenerator:
    return VllmGenerator(str(TINY_TARGET), "float32")


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return path


def module_ids(tokenizer, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` stdlib validation modules."""
    texts = [m.path.read_text() for m in list_modules("validation")[:n]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_replies_equal_hf_token_for_token(hf, vllm_generator: VllmGenerator) -> None:
    model, tokenizer = hf
    modules = module_ids(tokenizer, 40)
    # Heads and tails of stdlib modules (a tail ends a few tokens before the document, so some replies stop on the
    # end-of-text token after writing), and chat prompts stopped by the end-of-turn marker or the cap.
    text_prompts = [ids[:32] for ids in modules] + [ids[-40:-6] for ids in modules]
    chat_prompts = [prompt_ids(tokenizer, m[:1]) for m in CHATS]
    n_tokens = n_stopped = n_capped = 0
    for prompts, stops in ((text_prompts, text_stops(tokenizer)), (chat_prompts, stop_tokens(tokenizer))):
        ours = [r for i in range(0, len(prompts), 16) for r in generate_batch(model, prompts[i : i + 16], stops, 48)]
        theirs = vllm_generator(prompts, stops.ids, 48)
        assert theirs == ours
        n_tokens += sum(len(ids) for ids, _ in ours)
        n_stopped += sum(stopped for ids, stopped in ours if ids)
        n_capped += sum(not stopped for _, stopped in ours)
    assert n_stopped >= 3, "some replies should write tokens and then stop"
    assert n_capped >= 3, "some replies should run to the cap"
    print(f"greedy: {len(text_prompts) + len(chat_prompts)} prompts, {n_tokens} tokens equal, {n_stopped} stopped")


def test_engine_benchmark_smoke(capsys) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("data_engines", ROOT / "benchmarks" / "data_engines.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke"])
    out = capsys.readouterr().out
    assert "vllm / hf tokens/s:" in out and "greedy replies equal: 4/4" in out


def test_greedy_command_output_equals_hf(chats: Path, tmp_path: Path) -> None:
    """The whole command: multi-turn conversations (each turn conditioned on the regenerated earlier ones), text
    windows; the output files are byte for byte the HF engine's."""
    for kw in ({"batch_size": 3}, {"format": "text", "prompt_tokens": 24, "limit": 12, "batch_size": 5}):
        data = [str(chats)] if "format" not in kw else [str(copy_stdlib(tmp_path / "text", 3))]
        outputs = {}
        for engine in ("hf", "vllm"):
            out = tmp_path / f"{engine}-{kw.get('format', 'chat')}.jsonl"
            regenerate(str(TINY_TARGET), data, str(out), max_new_tokens=MAX_NEW, engine=engine, **kw)
            outputs[engine] = out.read_bytes()
        assert outputs["vllm"] == outputs["hf"]
        assert len(outputs["hf"].splitlines()) == (len(CHATS) if "format" not in kw else 12)


def test_sampled_output_is_seeded(chats: Path, tmp_path: Path) -> None:
    def run(out: Path, seed: int = 7, **kw) -> bytes:
        regenerate(str(TINY_TARGET), [str(chats)], str(out), max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
                   top_p=TOP_P, seed=seed, engine="vllm", **kw)  # fmt: skip
        return out.read_bytes()

    sampled = run(tmp_path / "a.jsonl", batch_size=4)
    # Each turn draws from vLLM's generator seeded by (seed, id, turn): the batch does not change the draws...
    assert run(tmp_path / "b.jsonl", batch_size=3) == sampled
    # ...nor does a resume (a torn last line cut off, the rest generated in other batches).
    lines = sampled.splitlines(keepends=True)
    resumed = tmp_path / "c.jsonl"
    resumed.write_bytes(b"".join(lines[:2]) + lines[2][:20])
    assert run(resumed, batch_size=1) == sampled
    assert run(tmp_path / "d.jsonl", seed=8, batch_size=4) != sampled
    greedy = tmp_path / "greedy.jsonl"
    regenerate(str(TINY_TARGET), [str(chats)], str(greedy), max_new_tokens=MAX_NEW, engine="vllm")
    assert greedy.read_bytes() != sampled


def reply_stats(model, prompts: list[list[int]], replies: list[list[int]]) -> dict[str, np.ndarray]:
    """Per reply: length, distinct-token rate, mean log-prob of its tokens under the target (temperature 1)."""
    lengths, distinct, logprob = [], [], []
    for prompt, reply in zip(prompts, replies, strict=True):
        lengths.append(len(reply))
        if not reply:
            continue
        distinct.append(len(set(reply)) / len(reply))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1].float()
        logprob.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None]).mean().item())
    return {"length": np.array(lengths, float), "distinct": np.array(distinct), "logprob": np.array(logprob)}


def z_scores(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """(mean a - mean b) over its standard error, per statistic."""
    return {
        k: (a[k].mean() - b[k].mean()) / np.sqrt(a[k].var(ddof=1) / len(a[k]) + b[k].var(ddof=1) / len(b[k])) for k in a
    }


def test_sampled_statistics_match_hf(hf, vllm_generator: VllmGenerator) -> None:
    model, tokenizer = hf
    stops = text_stops(tokenizer)
    windows = [ids[i : i + 32] for ids in module_ids(tokenizer, 40) for i in range(0, min(len(ids) - 32, 256), 64)]
    prompts = windows[:64]
    assert len(prompts) == 64
    seeds = [turn_seed(7, f"window{i}", 0) for i in range(len(prompts))]

    def hf_replies(temperature: float) -> list[list[int]]:
        out = []
        for i in range(0, len(prompts), 16):
            batch = generate_batch(model, prompts[i : i + 16], stops, MAX_NEW, temperature, TOP_P, seeds[i : i + 16])
            out += [ids for ids, _ in batch]
        return out

    ours = reply_stats(model, prompts, hf_replies(TEMPERATURE))
    theirs = reply_stats(model, prompts, [ids for ids, _ in vllm_generator(prompts, stops.ids, MAX_NEW, TEMPERATURE,
                                                                           TOP_P, seeds)])  # fmt: skip
    z = z_scores(theirs, ours)
    print("sampled, mean over 64 replies, hf / vllm / z:")
    for k in ours:
        print(f"  {k}: {ours[k].mean():.4f} / {theirs[k].mean():.4f} / {z[k]:+.2f}")
    assert all(abs(v) < 4 for v in z.values()), z
    # The comparison sees a temperature that is off: HF at 1.0 against HF at 0.7.
    hotter = z_scores(reply_stats(model, prompts, hf_replies(1.0)), ours)
    print(f"  power check, hf T=1.0 vs T={TEMPERATURE}: z = {hotter}")
    assert abs(hotter["logprob"]) > 4

    # The first token of one prompt under 400 seeds, against the exact distribution each engine should draw from.
    prompt = prompts[5]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    exact = nucleus(torch.softmax(logits / TEMPERATURE, -1), TOP_P)
    many = [turn_seed(11, f"draw{i}", 0) for i in range(400)]
    firsts = {
        "hf": [ids[0] for ids, _ in generate_batch(model, [prompt] * 400, stops, 1, TEMPERATURE, TOP_P, many)],
        "vllm": [ids[0] for ids, _ in vllm_generator([prompt] * 400, stops.ids, 1, TEMPERATURE, TOP_P, many)],
    }
    for engine, tokens in firsts.items():
        counts = torch.bincount(torch.tensor(tokens), minlength=exact.numel())
        p = chi2_pvalue(counts, exact)
        print(f"  first token, {engine}: chi-square p = {p:.3f} ({int((exact > 0).sum())} tokens in the nucleus)")
        assert p > 1e-3, engine
        assert counts[exact == 0].sum() == 0, f"{engine} drew outside the nucleus"


KILLED_RUN = """
import sys, time
import trainer.data.vllm_engine as engine
call = engine.VllmGenerator.__call__

def slow(*args, **kwargs):
    time.sleep(0.3)  # leaves time to kill the run between its writes
    return call(*args, **kwargs)

engine.VllmGenerator.__call__ = slow
from trainer.data.regenerate import regenerate
regenerate(sys.argv[1], [sys.argv[2]], sys.argv[3], max_new_tokens=int(sys.argv[4]), temperature=float(sys.argv[5]),
           top_p=float(sys.argv[6]), seed=7, batch_size=1, engine="vllm")
"""


def test_sigkill_resumes_without_duplicate_or_loss(chats: Path, tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    args = [str(TINY_TARGET), str(chats), str(out), str(MAX_NEW), str(TEMPERATURE), str(TOP_P)]
    log = tmp_path / "stderr.txt"
    with log.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, *args], env=env, stdout=stderr, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None, f"the run ended before it could be killed:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the run wrote nothing in 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    written = out.read_bytes().count(b"\n")
    assert 0 < written < len(CHATS), "the kill should land mid-run"
    regenerate(str(TINY_TARGET), [str(chats)], str(out), max_new_tokens=MAX_NEW, temperature=TEMPERATURE, top_p=TOP_P,
               seed=7, batch_size=3, engine="vllm")  # fmt: skip
    whole = tmp_path / "whole.jsonl"
    regenerate(str(TINY_TARGET), [str(chats)], str(whole), max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
               top_p=TOP_P, seed=7, batch_size=4, engine="vllm")  # fmt: skip
    ids = [r["id"] for r in records(out)]
    assert len(ids) == len(set(ids)) == len(CHATS)
    assert out.read_bytes() == whole.read_bytes()


@pytest.fixture(scope="module")
def text_spec(tmp_path_factory: pytest.TempPathFactory) -> DataSpec:
    text = copy_stdlib(tmp_path_factory.mktemp("stdlib"), 3)
    return DataSpec(paths=[str(text)], format="text", tokenizer=str(TINY_TARGET), max_length=96,
                    validation_fraction=0.25, seed=1)  # fmt: skip


def shard_tables(root: Path) -> dict[str, pa.Table]:
    return {str(p.relative_to(root)): pa.ipc.open_file(pa.memory_map(str(p), "r")).read_all()
            for p in sorted(root.rglob("shard-*.arrow"))}  # fmt: skip


def rounding_apart(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """Per stored float16 value: how far apart a and b are, in units of what two float32 results a float32 rounding
    apart may differ by once stored: one float16 step at their magnitude, plus 1e-5 of ``scale`` (the largest
    magnitude), which covers values near zero, where float16 steps are finer than float32's error. <= 1: agree."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    step = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float16)).astype(np.float32)
    return np.abs(a32 - b32) / (step + 1e-5 * scale)


def test_feature_caches_of_both_engines_agree(text_spec: DataSpec, tmp_path: Path) -> None:
    caches = {}
    for engine in ("hf", "vllm"):
        caches[engine] = tmp_path / engine
        cache_features(str(TINY_TARGET), LAYERS, str(caches[engine]), text_spec, topk=TOPK, shard_rows=3,
                       engine=engine)  # fmt: skip
    hf_tables, vllm_tables = shard_tables(caches["hf"]), shard_tables(caches["vllm"])
    assert hf_tables.keys() == vllm_tables.keys() and len(hf_tables) >= 3
    worst = {"features": 0.0, "teacher_topk_logprobs": 0.0}
    equal = total = 0
    for name, ours in hf_tables.items():
        theirs = vllm_tables[name]
        for column in ("input_ids", "loss_mask", "position_ids", "doc_ids", "teacher_topk_ids"):
            assert theirs.column(column).equals(ours.column(column)), (name, column)
        for column in worst:
            a = ours.column(column).combine_chunks().flatten().to_numpy()
            b = theirs.column(column).combine_chunks().flatten().to_numpy()
            worst[column] = max(worst[column], float(rounding_apart(a, b, float(np.abs(a).max())).max()))
            if column == "features":
                equal, total = equal + int((a == b).sum()), total + len(a)
    print(f"float16 store: features {equal / total:.4%} bit-equal ({total} values); worst distance {worst}")
    assert max(worst.values()) <= 1
    assert equal / total > 0.99
    manifest = json.loads((caches["vllm"] / "manifest.json").read_text())
    assert manifest["engines"] == ["vllm"] and manifest["complete"]

    # The float32 values before the store: the layers' outputs within 1e-5 of their largest magnitude.
    split = FeatureCache(caches["vllm"], expect_spec=text_spec).split("train")
    sample = [{k: split[i][k].tolist() for k in ("input_ids", "doc_ids", "position_ids", "loss_mask")}
              for i in range(3)]  # fmt: skip
    target = Target.from_pretrained(str(TINY_TARGET), LAYERS)
    vllm_rows = VllmFeatures(str(TINY_TARGET), LAYERS, TOPK, "float32", text_spec.max_length)(sample)
    for row, theirs in zip(sample, vllm_rows, strict=True):
        ours = {k: v[0] for k, v in online_features(target, collate([row], 0), TOPK).items()}
        relative = float((theirs["features"] - ours["features"]).abs().max() / ours["features"].abs().max())
        logprob_gap = float((theirs["teacher_topk_logprobs"] - ours["teacher_topk_logprobs"]).abs().max())
        print(f"float32: features {relative:.1e} of the largest magnitude apart, teacher log-probs {logprob_gap:.1e}")
        assert relative < 1e-5
        assert torch.equal(theirs["teacher_topk_ids"], ours["teacher_topk_ids"])
        assert logprob_gap < 1e-4

    # The offline training data module reads the vLLM cache as it reads the HF one.
    batches = {}
    for engine, root in caches.items():
        data = DraftData(text_spec, batch_size=2, features="offline", cache_dir=str(root))
        data.setup()
        batches[engine] = with_features(next(iter(data.val_dataloader())), None, TOPK)
    assert batches["vllm"]["features"].dtype == torch.float16
    assert batches["vllm"]["features"].shape[-1] == len(LAYERS) * 192
    for key in ("input_ids", "doc_ids", "teacher_topk_ids"):
        assert torch.equal(batches["vllm"][key], batches["hf"][key]), key
    torch.testing.assert_close(batches["vllm"]["features"], batches["hf"]["features"], rtol=2e-3, atol=2e-3)

    # A cache the HF engine began is finished by vLLM (same format); the manifest names both engines.
    shard = sorted(caches["hf"].rglob("shard-*.arrow"))[-1]
    shard.unlink()
    cache_features(str(TINY_TARGET), LAYERS, str(caches["hf"]), text_spec, topk=TOPK, shard_rows=3, engine="vllm")
    assert json.loads((caches["hf"] / "manifest.json").read_text())["engines"] == ["hf", "vllm"]
    FeatureCache(caches["hf"], expect_spec=text_spec)
