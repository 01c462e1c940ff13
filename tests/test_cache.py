import json
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import make_tiny_target

import trainer.data.cache as cache_mod
from trainer.data.cache import FeatureCache, cache_features
from trainer.data.features import with_features
from trainer.data.prepare import DataSpec
from trainer.drafters.vocab import DraftVocab
from trainer.errors import UserError
from trainer.target import Target
from trainer.training.datamodule import DraftData

LAYERS = [1, 3]
TOPK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    make_tiny_target(out, num_layers=4)
    return out


@pytest.fixture(scope="module")
def spec(tmp_path_factory, model_dir):
    d = tmp_path_factory.mktemp("chats")
    lines = []
    for i in range(24):
        turns = [
            {"role": "user", "content": f"What does f{i}() return?"},
            {"role": "assistant", "content": f"def f{i}():\n    return {i} * {i + 1}\n"},
        ]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "And twice?"}, {"role": "assistant", "content": f"{2 * i}"}]
        lines.append(json.dumps({"messages": turns}))
    (d / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return DataSpec(
        paths=[str(d / "chats.jsonl")], tokenizer=str(model_dir), max_length=96, validation_fraction=0.25, seed=1
    )


def run_cache(model_dir, spec, out, **kw):
    cache_features(str(model_dir), LAYERS, str(out), spec, topk=TOPK, shard_rows=2, batch_size=2, **kw)


def test_offline_batches_equal_online_batches(model_dir, spec, tmp_path):
    run_cache(model_dir, spec, tmp_path / "c", draft_vocab_size=40)
    target = Target.from_pretrained(str(model_dir), LAYERS)
    online = DraftData(spec, batch_size=3, features="online")
    offline = DraftData(spec, batch_size=3, features="offline", cache_dir=str(tmp_path / "c"))
    for split in ("train", "validation"):
        online.setup()
        offline.setup()
        on_rows, off_rows = online._datasets[split], offline._datasets[split]
        assert len(on_rows) == len(off_rows) > 0
    n_batches = 0
    for on, off in zip(online.val_dataloader(), offline.val_dataloader(), strict=True):
        on = with_features(on, target, TOPK)
        off = with_features(off, None, TOPK)
        for key in ("input_ids", "loss_mask", "position_ids", "doc_ids"):
            assert torch.equal(on[key], off[key]), key
        assert off["features"].dtype == torch.float16
        valid = on["doc_ids"] > 0
        torch.testing.assert_close(off["features"].float()[valid], on["features"][valid], rtol=1e-2, atol=1e-2)
        assert torch.equal(off["teacher_topk_ids"][valid], on["teacher_topk_ids"][valid])
        torch.testing.assert_close(
            off["teacher_topk_logprobs"].float()[valid], on["teacher_topk_logprobs"][valid], rtol=1e-2, atol=2e-2
        )
        n_batches += 1
    assert n_batches >= 1
    vocab = DraftVocab.load(tmp_path / "c" / "draft_vocab.safetensors")
    assert vocab.d2t.shape == (40,) and int(vocab.t2d.sum()) == 40


def test_reads_are_zero_copy_float16_views(model_dir, spec, tmp_path):
    run_cache(model_dir, spec, tmp_path / "c")
    split = FeatureCache(tmp_path / "c", expect_spec=spec).split("train")
    a, b = split[0], split[0]
    assert a["features"].dtype == torch.float16 and a["teacher_topk_logprobs"].dtype == torch.float16
    assert a["features"].shape[1] == len(LAYERS) * 32
    # Two reads hand out the same memory: views of the mapped file, not fresh copies.
    assert a["features"].data_ptr() == b["features"].data_ptr()


def _shard_arrays(root):
    out = {}
    for path in sorted(root.rglob("shard-*.arrow")):
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        out[path.relative_to(root)] = {c: table.column(c).to_pylist() for c in table.column_names}
    return out


def test_interrupted_cache_job_resumes_without_redoing_shards(model_dir, spec, tmp_path, monkeypatch):
    real_write = cache_mod._write_shard
    calls = {"n": 0}

    def dying_write(path, columns):
        if calls["n"] == 3:
            # What a kill mid-write leaves behind: a temporary file, never a shard.
            path.with_name(path.name + ".tmp999").write_bytes(b"half")
            raise KeyboardInterrupt("killed")
        calls["n"] += 1
        real_write(path, columns)

    monkeypatch.setattr(cache_mod, "_write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run_cache(model_dir, spec, tmp_path / "c")
    with pytest.raises(UserError, match="incomplete"):
        FeatureCache(tmp_path / "c")
    done = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("shard-*.arrow")}
    assert len(done) == 3
    monkeypatch.setattr(cache_mod, "_write_shard", real_write)
    run_cache(model_dir, spec, tmp_path / "c")
    assert all(p.stat().st_mtime_ns == t for p, t in done.items()), "finished shards were rewritten"
    run_cache(model_dir, spec, tmp_path / "fresh")
    assert _shard_arrays(tmp_path / "c") == _shard_arrays(tmp_path / "fresh")
    FeatureCache(tmp_path / "c", expect_spec=spec)


def test_cache_refuses_other_arguments_and_other_data(model_dir, spec, tmp_path):
    run_cache(model_dir, spec, tmp_path / "c")
    with pytest.raises(UserError, match=r"differs in \['topk'\]"):
        cache_features(str(model_dir), LAYERS, str(tmp_path / "c"), spec, topk=4, shard_rows=2)
    other = DataSpec(**{**vars(spec), "max_length": 64})
    with pytest.raises(UserError, match=r"spec differs in \['max_length'\]"):
        FeatureCache(tmp_path / "c", expect_spec=other)
    with pytest.raises(UserError, match="no feature cache"):
        FeatureCache(tmp_path / "nothing")


def test_draft_vocab_mapping():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    vocab = DraftVocab.from_counts(counts, 3)
    assert vocab.t2d.tolist() == [False, False, True, True, False, True]
    assert vocab.to_target(torch.arange(3)).tolist() == [2, 3, 5]
    assert vocab.d2t.tolist() == [2, 2, 3]
    assert vocab.to_draft(torch.tensor([5, 2])).tolist() == [2, 0]
    assert np.all(np.diff(vocab.d2t.numpy()) >= 0)


def test_vllm_engine_hands_the_job_to_vllms_python(model_dir, spec, tmp_path, monkeypatch):
    """Without vLLM here, ``--engine vllm`` runs the whole job in vLLM's environment: the arguments cross as JSON (the
    spec as a dict) and come back a DataSpec there (tests/test_vllm_data.py runs the engine itself)."""
    import trainer.data.vllm_engine as vllm_engine
    import trainer.data.vllm_main as vllm_main

    monkeypatch.setattr(vllm_engine, "vllm_importable", lambda: False)
    monkeypatch.delenv("TRAINER_VLLM_PYTHON", raising=False)
    with pytest.raises(UserError, match="TRAINER_VLLM_PYTHON"):
        run_cache(model_dir, spec, tmp_path / "c", engine="vllm")
    record = tmp_path / "argv.json"
    python = tmp_path / "vllm_python"
    python.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    python.chmod(0o755)
    run_cache(model_dir, spec, tmp_path / "c", engine="vllm", vllm_python=str(python))
    assert not (tmp_path / "c").exists(), "the job ran here instead of in vLLM's environment"
    argv = json.loads(record.read_text())
    assert argv[:3] == ["-m", "trainer.data.vllm_main", "cache"]

    received = {}
    monkeypatch.setattr(vllm_main, "vllm_importable", lambda: True)
    monkeypatch.setattr(vllm_main, "cache_features", lambda **kw: received.update(kw))
    vllm_main.main(argv[2:])
    assert received["spec"] == spec and received["layers"] == LAYERS and received["engine"] == "vllm"
    assert (received["topk"], received["shard_rows"], received["batch_size"]) == (TOPK, 2, 2)
    with pytest.raises(UserError, match="--engine 'tpu'"):
        run_cache(model_dir, spec, tmp_path / "c", engine="tpu")


def test_manifest_names_the_engines_that_wrote_it(model_dir, spec, tmp_path):
    run_cache(model_dir, spec, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["engines"] == ["hf"]
    # A cache from before the field was written by the HF engine: a resume keeps saying so.
    del manifest["engines"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    run_cache(model_dir, spec, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["engines"] == ["hf"]
