"""`trainer eval` end to end on config-built models, and its input errors."""

import json

import pytest
import yaml
from conftest import make_tiny_target

from trainer.cli import main
from trainer.drafters.dflash import DFlashDraftModel, build_config
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.snapshots import version_path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A config-built target, a DFlash drafter as a bare HF dir, a TreeFlash drafter inside a run directory."""
    import torch

    root = tmp_path_factory.mktemp("eval")
    config = make_tiny_target(root / "target", num_layers=4)
    torch.manual_seed(0)
    dflash = DFlashDraftModel(build_config(config, 1, 8, mask_token_id=3))
    dflash.save_pretrained(root / "dflash")
    treeflash = TreeFlashDraftModel.from_dflash(dflash)
    version = root / "run" / "lightning_logs" / "version_0"
    treeflash.save_pretrained(version / "hf")
    (version / "config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"target": str(root / "target")}}}))
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x):\n    return x"}) for i in range(2)) + "\n"
    )
    return root


def test_eval_writes_summary_for_every_tree_budget_and_condition(setup, capsys):
    out = setup / "out"
    main(
        ["eval", "--drafter", str(setup / "run"), "--prompts", str(setup / "prompts.jsonl"),
         "--tree", "chain,ddtree,treeflash,recycling", "--budget", "4,8", "--max-new-tokens", "12",
         "--temperature", "0.7", "--top-k", "50", "--out", str(out), "--check-lossless", "--ignore-eos"]
    )  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["conditions"]) == {"T=0.7", "greedy"}
    assert summary["conditions"]["T=0.7"]["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 50}
    for cond in summary["conditions"].values():
        assert cond["plain"]["tau"] == 1.0
        assert set(cond["runs"]) == {"chain", "ddtree", "treeflash", "recycling"}
        for by_budget in cond["runs"].values():
            assert set(by_budget) == {"4", "8"}
            for budget, r in by_budget.items():
                assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["speedup"] > 0
                assert r["speedup_prompts"]["n"] == 2 and all(p["speedup"] > 0 for p in r["prompts"])
                assert r["lossless"] is True
                assert r["mean_tree_size"] <= int(budget)
                assert [p["id"] for p in r["prompts"]] == ["p0", "p1"]
                assert all(len(p["tokens"]) == 12 and p["lossless"] for p in r["prompts"])
                assert 0 <= r["loop_fraction"] <= 1 and "repetition_4gram" in r
                assert set(r["ms_per_step"]) >= {"verify"}
    greedy = summary["conditions"]["greedy"]["runs"]
    # Sessions that draft count their forwards; recycling has no drafter.
    assert greedy["ddtree"]["4"]["drafter_forwards_per_step"] == 1.0
    assert greedy["recycling"]["4"]["drafter_forwards_per_step"] == 0.0
    assert summary["target"] == str(setup / "target")
    for name in ("summary.md", "tau_vs_budget.png", "acceptance_by_depth.png"):
        assert (out / name).stat().st_size > 0
    assert "| treeflash | 8 |" in (out / "summary.md").read_text()


def test_a_prompt_answered_by_its_first_token_has_no_tau(setup):
    """No verification step ran: its τ is null, not 0 (which would drag a mean over prompts down)."""
    out = setup / "out_first"
    main(["eval", "--drafter", str(setup / "run"), "--prompts", str(setup / "prompts.jsonl"), "--tree", "chain",
          "--budget", "4", "--max-new-tokens", "1", "--out", str(out), "--ignore-eos"])  # fmt: skip
    run = json.loads((out / "summary.json").read_text())["conditions"]["greedy"]["runs"]["chain"]["4"]
    assert [(len(p["tokens"]), p["tau"], p["speedup"]) for p in run["prompts"]] == [(1, None, None)] * 2


def run_expecting_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["eval", *args])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_eval_input_errors(setup, capsys, tmp_path):
    prompts, dflash = str(setup / "prompts.jsonl"), str(setup / "dflash")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x"}\n{"id": 2, "prompt": \n')
    err = run_expecting_error(capsys, "--drafter", dflash, "--target", str(setup / "target"), "--prompts", str(bad),
                              "--out", str(tmp_path / "o"))  # fmt: skip
    assert "bad.jsonl:2: not JSON" in err
    err = run_expecting_error(capsys, "--drafter", dflash, "--prompts", prompts, "--out", str(tmp_path / "o"))
    assert "pass --target" in err
    err = run_expecting_error(capsys, "--drafter", dflash, "--target", str(setup / "target"), "--prompts", prompts,
                              "--tree", "treeflash", "--out", str(tmp_path / "o"))  # fmt: skip
    assert "needs a TreeFlash drafter" in err and "DFlashDraftModel" in err
    err = run_expecting_error(capsys, "--drafter", dflash, "--prompts", prompts, "--tree", "ddtre",
                              "--out", str(tmp_path / "o"))  # fmt: skip
    assert "unknown tree builder 'ddtre'" in err
    err = run_expecting_error(capsys, "--drafter", str(tmp_path / "nope"), "--prompts", prompts,
                              "--out", str(tmp_path / "o"))  # fmt: skip
    assert "does not exist" in err
    assert not (tmp_path / "o").exists()


def test_eval_finishes_when_plots_fail(setup, capsys, monkeypatch, tmp_path):
    """A failing optional step (the plots) leaves the summaries written and says so in one line; no crash."""

    def broken(summary, out):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr("trainer.evaluate.plots", broken)
    out = tmp_path / "out"
    main(["eval", "--drafter", str(setup / "run"), "--prompts", str(setup / "prompts.jsonl"), "--tree", "ddtree",
          "--budget", "4", "--max-new-tokens", "4", "--out", str(out)])  # fmt: skip
    assert json.loads((out / "summary.json").read_text())["n_prompts"] == 2
    assert (out / "summary.md").stat().st_size > 0
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warning) == 1 and "plots not written" in warning[0] and "matplotlib" in warning[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--dtype", "float33"], "--dtype 'float33' is not one of float32, bfloat16, float16"),
        (["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'"),
        (["--budget", "4,x"], "--budget takes a comma-separated list of int"),
        (["--device", "gpu0"], "--device 'gpu0' is not a device"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--tree-opt", "eagle_depth"], "tree option 'eagle_depth'"),
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option 1"),
    ],
)
def test_eval_bad_arguments_fail_in_one_line(setup, capsys, tmp_path, args, expected):
    """Every bad argument is a one-line error and exit 2, like the rest of the CLI: no usage dump, no
    traceback, and nothing written."""
    err = run_expecting_error(capsys, "--drafter", str(setup / "run"), "--prompts", str(setup / "prompts.jsonl"),
                              "--out", str(tmp_path / "o"), *args)  # fmt: skip
    assert expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "usage:" not in err
    assert not (tmp_path / "o").exists()


def test_eval_missing_required_argument(capsys, tmp_path):
    err = run_expecting_error(capsys, "--out", str(tmp_path / "o"))
    assert "the following arguments are required: --prompts" in err and len(err.strip().splitlines()) == 1


def publish_adjacency(root, version: int, adjacency) -> None:
    """A snapshot in the published layout: ``root/vNNNNNN/adjacency.safetensors`` named by ``root/current``."""
    from safetensors.torch import save_file

    directory = version_path(root, version)
    directory.mkdir(parents=True)
    save_file({"adjacency": adjacency}, str(directory / "adjacency.safetensors"))
    (directory / "manifest.json").write_text(json.dumps({"version": version}))
    (root / "current").write_text(directory.name + "\n")


def test_eval_starts_graft_warm_from_a_published_snapshot(setup, capsys, tmp_path):
    import torch

    from trainer.decoding.drafting import RecyclingSession
    from trainer.evaluate import refresh_adjacency

    vocab = json.loads((setup / "target" / "config.json").read_text())["vocab_size"]
    publish = tmp_path / "publish"
    adjacency = torch.randint(0, vocab, (vocab, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    publish_adjacency(publish, 1, adjacency)
    out = tmp_path / "out"
    main(["eval", "--drafter", str(setup / "dflash"), "--target", str(setup / "target"),
          "--prompts", str(setup / "prompts.jsonl"), "--tree", "recycling,graft-dflash", "--budget", "8",
          "--max-new-tokens", "10", "--out", str(out), "--check-lossless", "--ignore-eos", "--adjacency", str(publish),
          "--tree-opt", "graft_thresholds=1.1,1.1,1.1"])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adjacency_version"] == 1
    run = summary["conditions"]["greedy"]["runs"]["graft-dflash"]["8"]
    # Pruned at the root every step, so all but 2 of the 8 nodes come from the published matrix.
    assert run["lossless"] is True and run["mean_tree_size"] == 8.0

    # Between requests, a newer snapshot replaces the loaded one; an older or equal one does not.
    memory = RecyclingSession(vocab, width=4)
    refresh_adjacency(memory, publish)
    assert memory.version == 1 and torch.equal(memory.adjacency, adjacency.long())
    publish_adjacency(publish, 2, adjacency.flip(-1))
    refresh_adjacency(memory, publish)
    assert memory.version == 2 and torch.equal(memory.adjacency, adjacency.flip(-1).long())

    (publish / "current").write_text("latest\n")
    err = run_expecting_error(capsys, "--drafter", str(setup / "dflash"), "--target", str(setup / "target"),
                              "--prompts", str(setup / "prompts.jsonl"), "--tree", "graft-dflash",
                              "--adjacency", str(publish), "--out", str(tmp_path / "o"))  # fmt: skip
    assert "not a version directory" in err
    publish_adjacency(publish, 3, torch.full((vocab, 4), vocab))
    err = run_expecting_error(capsys, "--drafter", str(setup / "dflash"), "--target", str(setup / "target"),
                              "--prompts", str(setup / "prompts.jsonl"), "--tree", "graft-dflash",
                              "--adjacency", str(publish), "--out", str(tmp_path / "o"))  # fmt: skip
    assert "outside" in err and "version 3" in err


class SimulatedClock:
    """Seconds that pass only in forwards, by a GPU-like cost model: a target forward costs 1 whatever its rows
    (verifying a few dozen tokens costs about one token on a large target), a drafter forward 0.1, and a target
    forward at an input shape not seen before 50 more (a kernel's first launch at a shape selects and loads it).
    Driven by forward pre-hooks, read through ``evaluate``'s ``now``."""

    def __init__(self, target, drafter) -> None:
        self.seconds = 0.0
        self.shapes: set[tuple[int, ...]] = set()
        target.register_forward_pre_hook(self.target_forward, with_kwargs=True)
        drafter.register_forward_pre_hook(self.drafter_forward, with_kwargs=True)

    def target_forward(self, module, args, kwargs) -> None:
        shape = tuple(kwargs["input_ids"].shape)
        self.seconds += 1.0 if shape in self.shapes else 51.0
        self.shapes.add(shape)

    def drafter_forward(self, module, args, kwargs) -> None:
        self.seconds += 0.1

    def __call__(self) -> float:
        return self.seconds


def test_eval_speedup_at_tau_one_is_at_most_one(setup):
    """A drafter that never matches (τ = 1) cannot be faster than plain decoding: each of its steps is a plain
    step plus a drafter forward. A configuration timed cold (plain decoding first and unwarmed, as on the first
    GPU run) or a ratio taken the wrong way round would read above 1 here."""
    import torch

    from trainer.decoding.verify import Sampling
    from trainer.drafters import load_drafter
    from trainer.evaluate import evaluate
    from trainer.target import load_causal_lm

    target = load_causal_lm(str(setup / "target"))
    drafter = load_drafter(setup / "dflash")
    with torch.no_grad():
        # The drafter's normed hidden states are 0, so its logits through the target's head are all 0 and its
        # chain drafts token 0 at every depth; the target's logit of token 0 is 0 too, below its best one.
        drafter.norm.weight.zero_()
        target.lm_head.weight[0].zero_()
    clock = SimulatedClock(target, drafter)
    prompts = [{"id": f"p{i}", "prompt": ""} for i in range(3)]
    encoded = [torch.tensor([5 + i, 9, 17 + 2 * i]) for i in range(3)]
    summary = evaluate(
        target, drafter, prompts, encoded, ["chain"], [4], {"greedy": Sampling()}, max_new_tokens=10, seed=0,
        check_lossless=True, stop_token_ids=set(), now=clock,
    )  # fmt: skip
    entry = summary["conditions"]["greedy"]
    run = entry["runs"]["chain"]["4"]
    assert run["tau"] == 1.0 and run["lossless"] is True
    assert all(p["tau"] == 1.0 for p in run["prompts"])
    # 9 plain steps of 1 against 9 steps of 1 + 0.1: every ratio is 1 / 1.1.
    assert run["speedup"] == pytest.approx(1 / 1.1)
    assert [p["speedup"] for p in run["prompts"]] == pytest.approx([1 / 1.1] * 3)
    spread = run["speedup_prompts"]
    assert spread["n"] == 3 and spread["median"] == pytest.approx(1 / 1.1) and spread["stderr"] == pytest.approx(0)
    assert spread["q10"] <= spread["median"] <= spread["q90"] <= 1.0


def test_speedup_spread_over_prompts():
    from trainer.evaluate import spread

    s = spread([1.0, None, 2.0, 3.0, 4.0])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["median"] == 2.5
    # Sample standard deviation sqrt(5/3) over sqrt(4) prompts; quantiles interpolate linearly.
    assert s["stderr"] == pytest.approx((5 / 3) ** 0.5 / 2)
    assert s["q10"] == pytest.approx(1.3) and s["q90"] == pytest.approx(3.7)
    assert spread([1.5])["stderr"] is None and spread([None])["n"] == 0
