import json

import datasets
import pytest

from trainer.data.sources import LoadReport, load_chat, load_text, split_train_validation
from trainer.errors import UserError

OPENAI = {
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
}
SHAREGPT = {"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}


def write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_openai_and_sharegpt_normalise_to_messages(tmp_path):
    ds = load_chat([write_jsonl(tmp_path / "a.jsonl", [OPENAI, SHAREGPT])])
    assert ds[0]["messages"][2] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    assert [m["role"] for m in ds[1]["messages"]] == ["user", "assistant"]
    assert ds[1]["source"].endswith("a.jsonl:2")


def test_json_list_parquet_and_directories(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.json").write_text(json.dumps([OPENAI, OPENAI]))
    datasets.Dataset.from_list([SHAREGPT] * 3).to_parquet(str(tmp_path / "d" / "y.parquet"))
    ds = load_chat([tmp_path / "d"])
    assert len(ds) == 5
    assert ds[4]["source"].endswith("y.parquet#2")


def test_malformed_rows_are_counted_with_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            OPENAI,
            "{not json",
            {"messages": [{"role": "wizard", "content": "x"}]},
            {"conversations": [{"from": "human", "value": "only a question"}]},
            {"text": "no conversation"},
            SHAREGPT,
            {"messages": [{"role": "assistant", "content": 3}]},
        ],
    )
    report = LoadReport()
    ds = load_chat([path], report=report)
    assert len(ds) == 2 and report.kept == 2
    assert len(report.malformed) == 5
    lines = [m.split(": ")[0].rsplit(":", 1)[1] for m in report.malformed]
    assert lines == ["2", "3", "4", "5", "7"]
    assert "invalid JSON" in report.malformed[0] and "wizard" in report.malformed[1]
    assert "no assistant turn" in report.malformed[2]
    with pytest.raises(UserError, match=r"malformed row at .*bad.jsonl:2: invalid JSON"):
        load_chat([path], strict=True)


def test_empty_result_is_an_error(tmp_path):
    with pytest.raises(UserError, match="no usable conversation rows"):
        load_chat([write_jsonl(tmp_path / "e.jsonl", ["{", {"x": 1}])])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="no usable"):
        load_chat([tmp_path / "empty.jsonl"])
    with pytest.raises(UserError, match="not found"):
        load_chat([tmp_path / "missing.jsonl"])


def test_text_files_and_undecodable_ones(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_bytes(b"\xff\xfe bad")
    (tmp_path / "c.bin").write_bytes(b"ignored")
    ds = load_text([tmp_path])
    assert ds["text"] == ["x = 1\n"]


def test_split_is_deterministic_and_disjoint(tmp_path):
    ds = datasets.Dataset.from_list([{"i": i} for i in range(50)])
    tr1, va1 = split_train_validation(ds, 0.2, seed=3)
    tr2, va2 = split_train_validation(ds, 0.2, seed=3)
    _, va3 = split_train_validation(ds, 0.2, seed=4)
    assert va1["i"] == va2["i"] and tr1["i"] == tr2["i"]
    assert len(va1) == 10 and not set(va1["i"]) & set(tr1["i"])
    assert va1["i"] != va3["i"]
