"""The graft proposer against a fake runner (no vLLM needed): what each table learns from verified nodes and prompt
positions, who drafts from which table, the chains it drafts, its version switches, and that it fails open. The
same proposer inside a real vLLM engine: tests/test_vllm_graft.py (marker vllm)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from test_vllm_hooks import V, params, request, runner, step

from trainer.integrations.vllm import hooks
from trainer.integrations.vllm.config import PluginConfig, PluginError
from trainer.integrations.vllm.graft import GraftProposer
from trainer.sampling import top_rows
from trainer.snapshots import ADJACENCY, ADJACENCY_TENSOR, DELTA_ROWS, publish, tenant_filename

DEPTH = 3


@pytest.fixture(autouse=True)
def quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_VLLM_METRICS_DIR", str(tmp_path))
    monkeypatch.setattr(hooks, "fix_cpu_expansion", lambda: False)


def served(tmp_path: Path, monkeypatch, fake: SimpleNamespace, learn: bool = True) -> tuple:
    """A plugin in this process and vLLM's runner built with the graft proposer as its drafter."""
    monkeypatch.setenv("TRAINER_VLLM_WATCH", str(tmp_path / "pub"))
    monkeypatch.setenv("TRAINER_VLLM_GRAFT_LEARN", "1" if learn else "0")
    plugin = hooks.Plugin(PluginConfig.from_env())
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=DEPTH),
                             model_config=SimpleNamespace(get_vocab_size=lambda: V))  # fmt: skip
    fake.drafter = GraftProposer(config)
    fake.speculative_config.method = "custom_class"
    plugin.runner_init(lambda r: None, fake)
    return plugin, fake.drafter


def tenant_request(prompt: list[int], output: list[int], tenant: str | None, shareable: bool) -> SimpleNamespace:
    state = request(prompt, output)
    state.sampling_params = params(extra_args={"tenant": tenant, "shareable": shareable})
    return state


def test_the_proposer_needs_the_plugin(monkeypatch):
    for name in ("TRAINER_VLLM_WATCH", "TRAINER_VLLM_LOG_DIR", "TRAINER_VLLM_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PluginError, match="TRAINER_VLLM_WATCH"):
        GraftProposer(SimpleNamespace())


def test_verified_nodes_teach_the_tables_of_their_requests_only(tmp_path, monkeypatch):
    fake = runner(
        shared=tenant_request([1, 2, 3], [4], None, True),
        mine=tenant_request([1, 2, 3], [9], "acme", False),
        nobody=tenant_request([1, 2, 3], [11], None, False),
    )
    plugin, graft = served(tmp_path, monkeypatch, fake)
    logits = torch.randn(9, V)
    step(plugin, fake, logits)  # each request verified drafts [5, 6] after its root
    top = top_rows(logits, 8)[0]
    assert plugin.recorder.served.tree == "vllm-graft" and plugin.recorder.served.drafter is None
    # The shareable request's nodes (root 4, drafts 5, 6: logit rows 0..2) teach the shared table; the private
    # request of tenant acme (root 9, rows 3..5) teaches acme's table only; the last one teaches nobody.
    assert torch.equal(graft.shared.adjacency[4], top[0]) and (graft.shared.adjacency[9] == -1).all()
    acme = graft.tenants["acme"]
    assert torch.equal(acme.adjacency[9], top[3]) and torch.equal(acme.adjacency[6], top[5])
    assert (acme.adjacency[4] == -1).all()
    assert (graft.shared.adjacency[11] == -1).all() and (acme.adjacency[11] == -1).all()
    # Draft 6 was verified by two requests; the shared table keeps its row from the shareable one.
    assert torch.equal(graft.shared.adjacency[6], top[2])


def test_prompt_positions_teach_from_the_targets_logits(tmp_path, monkeypatch):
    prefill = SimpleNamespace(num_computed_tokens=2, num_prompt_tokens=6, num_tokens=6,
                              prompt_token_ids=[1, 2, 3, 4, 5, 6], sampling_params=params())  # fmt: skip
    fake = runner(p=prefill, d=request([7, 8], [9]))
    fake.query_start_loc = SimpleNamespace(cpu=torch.tensor([0, 4, 5]))
    head = torch.randn(16, V)
    fake.model = SimpleNamespace(compute_logits=lambda hidden: hidden @ head)
    plugin, graft = served(tmp_path, monkeypatch, fake)
    hidden = torch.randn(5, 16)
    scheduled = SimpleNamespace(num_scheduled_tokens={"p": 4, "d": 1})
    plugin.propose(lambda r, *a: [[]] * 2, fake, scheduled, [[], [9]], None, hidden)
    # The chunk computed prompt positions 2..5 (tokens 3, 4, 5, 6): their rows hold the top of their logits; the
    # decoding request's row is not a prompt position.
    top = top_rows(hidden[:4] @ head, 8)[0]
    for i, token in enumerate([3, 4, 5, 6]):
        assert torch.equal(graft.shared.adjacency[token], top[i])
    assert (graft.shared.adjacency[[1, 2, 9]] == -1).all()


def test_chains_follow_the_best_successor_and_a_frozen_table_learns_nothing(tmp_path, monkeypatch):
    fake = runner(a=request([1, 2], [3]), b=request([1, 2], [8]), c=request([1], []))
    plugin, graft = served(tmp_path, monkeypatch, fake, learn=False)
    table = torch.full((V, 8), -1)
    table[3, :2] = torch.tensor([10, 11])
    table[10, 0], table[11, 0], table[12, 0] = 12, 13, 14
    graft.shared.set_adjacency(table, 1)
    tokens = torch.zeros(3, 8, dtype=torch.long)
    tokens[0, :3], tokens[1, :3] = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 8])
    drafts = graft.propose([[3], [8], []], [3, 3, 1], tokens)
    # Depth 3 from root 3: 10, 12, 14; root 8 has no known successor; a partial prefill drafts nothing.
    assert drafts == [[10, 12, 14], [], []]
    step(plugin, runner(a=request([1, 2], [3])), torch.randn(3, V))
    assert torch.equal(graft.shared.adjacency, table)


def publish_table(pub: Path, table: torch.Tensor, tenants: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None):
    def payload(directory: Path) -> None:
        save_file({ADJACENCY_TENSOR: table}, directory / ADJACENCY)
        for name, (rows, delta) in (tenants or {}).items():
            save_file({DELTA_ROWS: rows, ADJACENCY_TENSOR: delta}, directory / tenant_filename(name))

    return publish(pub, payload, {"kind": "adjacency"})


def test_versions_switch_between_steps_tenants_get_their_delta_and_a_bad_version_is_refused(tmp_path, monkeypatch):
    fake = runner(a=tenant_request([1, 2], [3], "acme", True))
    plugin, graft = served(tmp_path, monkeypatch, fake, learn=False)
    graft.watch = tmp_path / "pub"
    table = torch.full((V, 8), -1, dtype=torch.int32)
    table[3, 0] = 20
    publish_table(graft.watch, table, {"acme": (torch.tensor([3]), torch.full((1, 8), 30, dtype=torch.int32))})
    graft.check_once()
    assert graft.version is None, "prepared off the engine thread, switched in at the next step"
    tokens = torch.tensor([[1, 2, 3]])
    # acme's first table is the shared matrix; its own view (the delta over it) is loaded off the engine thread.
    assert graft.propose([[3]], [3], tokens) == [[20]]
    assert graft.version == 1
    graft.check_once()  # loads acme's view of version 1
    assert graft.propose([[3]], [3], tokens) == [[30]]
    graft.shared.adjacency[5, 0] = 6  # a row learnt here since the load: kept by the next version (the merge rule)
    publish_table(graft.watch, torch.full((V + 1, 8), 1, dtype=torch.int32))
    graft.check_once()
    graft.propose([[3]], [3], tokens)
    assert graft.version == 1 and graft.refused == {2} and plugin.errors == {"graft": 1}
    table[3, 0] = 21
    publish_table(graft.watch, table)
    graft.check_once()
    graft.propose([[3]], [3], tokens)
    assert graft.version == 3 and int(graft.shared.adjacency[3, 0]) == 21 and int(graft.shared.adjacency[5, 0]) == 6
    assert graft.tenants["acme"].version == 3
    assert plugin.figures.values["adjacency_version"] == 3, "vLLM's /metrics shows the version in use"


def test_a_failing_proposer_drafts_nothing_and_is_counted(tmp_path, monkeypatch):
    fake = runner(a=request([1, 2], [3]))
    plugin, graft = served(tmp_path, monkeypatch, fake)
    fake.input_batch = None  # the runner's state is not what the proposer expects
    assert graft.propose([[3], [4]], [3, 3], torch.zeros(2, 4, dtype=torch.long)) == [[], []]
    assert plugin.errors == {"graft": 1}
