"""Continuous batching: every request's output equals its single-request output, whatever joins or leaves the
batch around it (mixed prompt lengths, staggered arrival, cancellation), greedy and sampled under its seed; block
drafters drafting all rows in one forward draft what each row's own forward would."""

import json
import time

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding.batch import BatchEngine, BatchRequest, Fixed
from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.drafting import GraftSession, RecyclingSession, draft_blocks
from trainer.decoding.engine import generate
from trainer.decoding.verify import Sampling
from trainer.drafters import load_drafter
from trainer.errors import UserError
from trainer.evaluate import refresh_adjacency
from trainer.snapshots import load_adjacency, publish, version_path


@pytest.fixture(scope="module")
def shipped():
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    drafter = load_drafter(ROOT / "checkpoints" / "dflash_tiny")
    lines = (ROOT / "data" / "prompts" / "stdlib_heldout.jsonl").read_text().splitlines()
    # Mixed lengths, so rows are ragged from the start.
    prompts = [
        torch.tensor(tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"][-n:])
        for line, n in zip(lines[:4], (40, 7, 96, 23), strict=True)
    ]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def treeflash():
    return load_drafter(ROOT / "checkpoints" / "treeflash_tiny")


@pytest.mark.parametrize("tree,budget", [("none", 0), ("recycling", 16), ("ddtree", 8), ("treeflash", 8)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_batched_output_equals_single_request_output(shipped, treeflash, tree, budget, temperature):
    target, drafter, prompts = shipped
    drafter = treeflash if tree == "treeflash" else drafter
    sampling = Sampling(temperature=temperature)
    singles = [
        generate(
            target, make_session(tree, target, drafter), BUILDERS[tree], p, 24, budget, sampling,
            torch.Generator().manual_seed(i),
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    references = [g.tokens for g in singles]
    engine = BatchEngine(target, drafter, (tree,), Fixed(tree, budget))
    requests = [BatchRequest(p, 24, sampling, torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)]
    # A request that joins and is cancelled mid-run must not disturb the others.
    victim = BatchRequest(prompts[2], 24, sampling, torch.Generator().manual_seed(9))
    arrivals = {0: [requests[0], requests[1]], 2: [requests[2], victim], 3: [requests[3]]}
    widest, n = 0, 0
    while n < 4 or engine.busy:
        for request in arrivals.get(n, []):
            engine.submit(request)
        if n == 4:
            victim.cancelled = True
        engine.step()
        widest = max(widest, len(engine.rows))
        # The ragged cache holds exactly each row's committed positions.
        assert engine.cache.valid.sum(1).tolist() == [r.past_len for r in engine.rows]
        n += 1
    assert widest >= 4
    assert [r.tokens for r in requests] == references
    assert all(r.finish_reason == "length" for r in requests) and victim.finish_reason == "cancelled"
    assert engine.cache.length == 0
    if tree != "recycling":  # Recycling's adjacency is shared by the batch, so its trees differ from a lone run's.
        # Batched drafting drafted each row's own trees: every step accepted what the lone run's step did.
        assert [[s.accepted for s in r.steps] for r in requests] == [[s.accepted for s in g.steps] for g in singles]


def test_one_block_forward_drafts_what_each_row_drafts_alone(shipped, treeflash):
    """Ragged cached contexts, pending contexts and depths; the sessions' caches stay equal to lone ones."""
    target, drafter, prompts = shipped
    for model in (drafter, treeflash):
        alone = [make_session("ddtree", target, model) for _ in prompts]
        batched = [make_session("ddtree", target, model) for _ in prompts]
        roots = []
        for prompt, a, b in zip(prompts, alone, batched, strict=True):
            out = target(input_ids=prompt[None], output_hidden_states=True)
            features = torch.cat([out.hidden_states[i + 1][0] for i in a.layer_ids], dim=-1)
            a.start(prompt, features, out.logits[0])
            b.start(prompt, features, out.logits[0])
            roots.append(int(out.logits[0, -1].argmax()))
        depths = [15, 2, 7, 40]
        generator = torch.Generator().manual_seed(0)
        for step in range(3):
            draft_blocks(batched, roots, depths)
            for a, b, root, depth in zip(alone, batched, roots, depths, strict=True):
                torch.testing.assert_close(b._block(root, depth), a._block(root, depth), atol=1e-4, rtol=0)
                assert b.forwards == a.forwards == step + 1
                for mine, theirs in zip(b.cache.layers, a.cache.layers, strict=True):
                    torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-4, rtol=0)
            # Rows commit different numbers of positions, so the next contexts are ragged too.
            for n, (a, b) in enumerate(zip(alone, batched, strict=True)):
                committed = torch.randint(0, 8192, (n + 1,), generator=generator).tolist()
                features = torch.randn(n + 1, a.drafter.fc.in_features, generator=generator)
                a.commit(committed, features, None, None)
                b.commit(committed, features, None, None)
            roots = [r + 1 for r in roots]
            depths = [max(d - 3, 0) for d in depths]
        with pytest.raises(RuntimeError, match="asked for"):
            draft_blocks(batched, roots, depths)
            batched[0]._block(roots[0] + 1, depths[0])


def test_stop_token_ends_only_its_request(shipped):
    target, _, prompts = shipped
    free = generate(target, make_session("none", target, None), BUILDERS["none"], prompts[0], 24, 0).tokens
    stop = free[5]
    engine = BatchEngine(target, None, ("recycling",), Fixed("recycling", 16))
    stopped = BatchRequest(prompts[0], 24, stop_token_ids=frozenset({stop}))
    other = BatchRequest(prompts[1], 24)
    engine.submit(stopped)
    engine.submit(other)
    while engine.busy:
        engine.step()
    assert stopped.tokens == free[: free.index(stop) + 1] and stopped.finish_reason == "stop"
    assert len(other.tokens) == 24


def test_a_published_adjacency_fills_rows_the_server_did_not_learn(shipped):
    target, _, prompts = shipped
    engine = BatchEngine(target, None, ("recycling",), Fixed("recycling", 16))
    request = BatchRequest(prompts[0], 8)
    engine.submit(request)
    while engine.busy:
        engine.step()
    learnt = engine.recycling.adjacency.clone()
    own = (learnt >= 0).any(1)
    published = torch.randint(0, 8192, (8192, 4))
    engine.set_adjacency(published)
    merged = engine.recycling.adjacency
    assert merged.shape == (8192, 4)
    assert torch.equal(merged[own], learnt[own, :4]) and torch.equal(merged[~own], published[~own])
    # At the next load, rows unchanged since are the snapshot's to replace.
    newer = torch.randint(0, 8192, (8192, 4))
    engine.set_adjacency(newer)
    assert torch.equal(engine.recycling.adjacency, newer)
    with pytest.raises(UserError, match=r"shape \(8192, k\)"):
        engine.set_adjacency(torch.zeros(17, 4, dtype=torch.long))
    assert torch.equal(engine.recycling.adjacency, newer)


def test_graft_sessions_graft_from_the_engines_published_adjacency_and_stay_lossless(shipped):
    target, drafter, prompts = shipped
    engine = BatchEngine(target, drafter, ("graft-dflash",), Fixed("graft-dflash", 16))
    published = torch.randint(0, 8192, (8192, 4))
    engine.set_adjacency(published)
    assert engine.recycling.adjacency.data_ptr() != published.data_ptr()  # learning must not write the snapshot
    requests = [BatchRequest(p, 16) for p in prompts[:2]]
    for request in requests:
        engine.submit(request)
    engine.step()
    memories = [r.sessions[GraftSession].memory for r in engine.rows]
    assert len(memories) == 2 and all(m is engine.recycling for m in memories)
    # Rows the two prompts and first trees did not rewrite are the snapshot's: what the trees graft from.
    learnt = (engine.recycling.adjacency != published).any(1)
    assert 0 < int(learnt.sum()) < 8192 // 4
    assert torch.equal(memories[0].adjacency[~learnt], published[~learnt])
    while engine.busy:
        engine.step()
    plain = [
        generate(target, make_session("none", target, None), BUILDERS["none"], p, 16, 0, Sampling()).tokens
        for p in prompts[:2]
    ]
    assert [r.tokens for r in requests] == plain


def test_prefill_topk_is_the_targets_topk_at_every_prompt_position(shipped):
    """The prompt evidence of the verifier log: kept when the prefill computes every prompt position's logits
    (a recycling session learns from them), never computed for it otherwise."""
    target, drafter, prompts = shipped
    with torch.no_grad():
        expected = target(prompts[1][None]).logits[0].topk(8, dim=-1).indices
    engine = BatchEngine(target, None, ("recycling",), Fixed("recycling", 16), prefill_topk=8)
    request = BatchRequest(prompts[1], 4)
    engine.submit(request)
    while engine.busy:
        engine.step()
    assert torch.equal(request.prefill_topk, expected) and request.tokens[0] == int(expected[-1, 0])
    plain = BatchEngine(target, drafter, ("ddtree",), Fixed("ddtree", 8), prefill_topk=8)
    request = BatchRequest(prompts[1], 4)
    plain.submit(request)
    while plain.busy:
        plain.step()
    assert request.prefill_topk is None


class Scripted:
    """Drafts with DDTree whenever every row can; gives DFlash sessions to requests admitted while ``want``."""

    def __init__(self) -> None:
        self.want = False
        self.available: list[frozenset[str]] = []

    def choose(self, batch_size, available=None):
        self.available.append(available)
        return ("ddtree", 8) if "ddtree" in available else ("none", 0)

    def observe(self, tree, budget, batch_size, rows, seconds):
        return None

    def ready(self, tree):
        return self.want

    def speculating(self):
        return True


def test_a_drafter_session_only_for_requests_the_policy_wants_ready(shipped):
    target, drafter, prompts = shipped
    kind = BUILDERS["ddtree"].session
    policy = Scripted()
    engine = BatchEngine(target, drafter, ("none", "ddtree"), policy)
    early = BatchRequest(prompts[0], 6)
    engine.submit(early)
    engine.step()
    assert kind not in early.sessions and policy.available[-1] == frozenset({"none"})
    policy.want = True
    late = BatchRequest(prompts[1], 24)
    engine.submit(late)
    while not early.finished:
        engine.step()
        # A row without the drafter's session keeps the drafter's builders out of the whole batch.
        assert "ddtree" not in policy.available[-1]
    assert kind in late.sessions
    while engine.busy:
        engine.step()
    assert "ddtree" in policy.available[-1]
    assert any(step.tree_size > 0 for step in late.steps)
    # Greedy: whatever each step drafted, the output is plain greedy decoding's.
    for request, prompt in ((early, prompts[0]), (late, prompts[1])):
        plain = make_session("none", target, None)
        alone = generate(target, plain, BUILDERS["none"], prompt, request.max_new_tokens, 0)
        assert request.tokens == alone.tokens


class Learning:
    """Plain decoding while keeping drafting state learning (or not: ``speculate``); records what each step was
    charged."""

    def __init__(self, speculate: bool = True) -> None:
        self.seconds: list[float] = []
        self.speculate = speculate

    def choose(self, batch_size, available=None):
        return ("none", 0)

    def observe(self, tree, budget, batch_size, rows, seconds):
        self.seconds.append(seconds)

    def ready(self, tree):
        return True

    def speculating(self):
        return self.speculate


@pytest.mark.parametrize("speculate", [False, True])
def test_the_shared_adjacency_learns_prompts_and_plain_steps_only_while_the_policy_may_draft(shipped, speculate):
    target, drafter, prompts = shipped
    engine = BatchEngine(target, drafter, ("none", "recycling"), Learning(speculate))
    before = engine.recycling.adjacency.clone()
    engine.submit(BatchRequest(prompts[0], 4))
    while engine.busy:
        engine.step()
    changed = (engine.recycling.adjacency != before).any(1)
    # Speculating: every prompt position and every verified node taught its row; otherwise nothing did.
    assert bool(changed[prompts[0]].all()) if speculate else not changed.any()


def test_a_plain_step_is_not_charged_for_the_learning_it_does_for_a_drafting_arm(shipped, monkeypatch):
    target, drafter, prompts = shipped
    policy = Learning()
    engine = BatchEngine(target, drafter, ("none", "recycling"), policy)
    learned = []
    slow = engine.recycling.learn

    def learn(*args):
        learned.append(True)
        time_before = time.perf_counter()
        slow(*args)
        while time.perf_counter() - time_before < 0.2:
            pass

    monkeypatch.setattr(engine.recycling, "learn", learn)
    engine.submit(BatchRequest(prompts[0], 4))
    while engine.busy:
        engine.step()
    # Every plain step learned (0.2 s each), and none was charged for it: a step of the tiny target takes ms.
    assert len(learned) >= len(policy.seconds) == 3
    assert max(policy.seconds) < 0.1


class Failing(Exception):
    pass


def test_a_failed_prefill_or_step_ends_the_requests_it_touched_and_the_engine_serves_on(shipped):
    """Injected through the engine's ``fault`` seam: a prefill that raises ends its request alone; a step that
    raises ends the batch's rows; both with finish reason "error" and what failed; waiting requests and the next
    ones are served as if nothing happened."""
    target, _, prompts = shipped
    engine = BatchEngine(target, None, ("recycling",), Fixed("recycling", 8))
    failures = []
    engine.on_failure = lambda phase, requests, error: failures.append((phase, list(requests), error))
    doomed = BatchRequest(prompts[1], 8)

    def fault(phase, requests):
        if phase == "prefill" and requests == [doomed]:
            raise Failing("prefill boom")

    engine.fault = fault
    ok = BatchRequest(prompts[0], 8)
    for request in (doomed, ok):
        engine.submit(request)
    while engine.busy:
        engine.step()
    assert doomed.finished and doomed.finish_reason == "error" and "prefill boom" in doomed.error
    assert ok.finish_reason == "length" and ok.error is None
    plain = generate(target, make_session("none", target, None), BUILDERS["none"], prompts[0], 8, 0).tokens
    assert ok.tokens == plain
    assert [(phase, requests) for phase, requests, _ in failures] == [("prefill", [doomed])]

    # A step that raises: both rows in the batch end with the error; a request still waiting is not touched.
    engine.fault, engine.max_batch = None, 2
    rows = [BatchRequest(p, 8) for p in prompts[:2]]
    for request in rows:
        engine.submit(request)
    engine.step()
    waiting = BatchRequest(prompts[2], 8)
    engine.submit(waiting)

    def fail_step(phase, requests):
        if phase == "step":
            raise Failing("step boom")

    engine.fault = fail_step
    engine.step()
    assert all(r.finish_reason == "error" and "step boom" in r.error for r in rows)
    assert failures[-1][0] == "step" and failures[-1][1] == rows
    assert not engine.rows and not waiting.finished
    engine.fault = None
    while engine.busy:
        engine.step()
    alone = generate(target, make_session("none", target, None), BUILDERS["none"], prompts[2], 8, 0).tokens
    assert waiting.finish_reason == "length" and waiting.tokens == alone


def test_a_request_keeps_the_drafter_version_it_was_admitted_with(shipped):
    """``set_drafter`` serves requests that join afterwards; one in flight is drafted by its old drafter's sessions
    to the end and keeps that version; a request without a drafter's session has none."""
    target, drafter, prompts = shipped
    policy = Scripted()
    engine = BatchEngine(target, drafter, ("none", "ddtree"), policy)
    plain = BatchRequest(prompts[0], 4)
    engine.submit(plain)
    engine.set_drafter(drafter, 1)
    engine.step()
    policy.want = True
    old = BatchRequest(prompts[1], 24)
    engine.submit(old)
    while not plain.finished:
        engine.step()
    engine.set_drafter(load_drafter(ROOT / "checkpoints" / "dflash_tiny"), 2)
    new = BatchRequest(prompts[3], 8)
    engine.submit(new)
    while engine.busy:
        engine.step()
    assert plain.drafter_version is None and old.drafter_version == 1 and new.drafter_version == 2
    assert old.sessions[BUILDERS["ddtree"].session].drafter is drafter
    assert new.sessions[BUILDERS["ddtree"].session].drafter is not drafter


def test_the_shared_adjacency_learns_once_per_step_under_graft_and_recycling(shipped, monkeypatch):
    """Graft sessions share the engine's adjacency with the recycling arm: the engine teaches it once per step
    (and once per admitted prompt), not once more through every Graft session."""
    target, drafter, prompts = shipped
    engine = BatchEngine(target, drafter, ("recycling", "graft-dflash"), Fixed("graft-dflash", 8))
    calls = []
    learn = engine.recycling.learn
    monkeypatch.setattr(engine.recycling, "learn", lambda *args: calls.append(1) or learn(*args))
    for prompt in prompts[:2]:
        engine.submit(BatchRequest(prompt, 8))
    engine.step()
    # Two prompts, then one step of two rows.
    assert len(calls) == 3
    steps = engine.steps
    engine.step()
    assert engine.steps == steps + 1 and len(calls) == 4


def test_eval_and_the_server_merge_a_snapshot_by_one_rule(shipped, tmp_path):
    """``trainer eval --adjacency`` (``refresh_adjacency``) and ``trainer serve --watch`` (``set_adjacency``) load
    the same snapshot over the same locally learnt rows into the same matrix."""
    target, _, prompts = shipped
    engine = BatchEngine(target, None, ("recycling",), Fixed("recycling", 8))
    engine.submit(BatchRequest(prompts[0], 8))
    while engine.busy:
        engine.step()
    memory = RecyclingSession(target.config.vocab_size, engine.options.recycling_width)
    memory.adjacency = engine.recycling.adjacency.clone()
    learnt = (memory.adjacency >= 0).any(1)
    torch.manual_seed(0)
    snapshot = torch.randint(0, 8192, (8192, 4))
    version = publish(tmp_path, lambda d: save_file({"adjacency": snapshot}, str(d / "adjacency.safetensors")), {})
    refresh_adjacency(memory, tmp_path)
    engine.set_adjacency(load_adjacency(version_path(tmp_path, version)), version)
    assert torch.equal(memory.adjacency, engine.recycling.adjacency)
    assert memory.version == engine.recycling.version == version
    assert torch.equal(memory.adjacency[~learnt], snapshot[~learnt])


def test_a_drafter_that_cannot_serve_the_engines_builders_is_refused_when_set(shipped):
    """Refused when the engine is made or the drafter swapped, not in each request's prefill; a refused swap keeps
    the drafter in use."""
    target, drafter, _ = shipped
    eagle = load_drafter(ROOT / "checkpoints" / "eagle3_tiny")
    with pytest.raises(UserError, match="'ddtree' needs a DFlash or TreeFlash drafter"):
        BatchEngine(target, eagle, ("ddtree",), Fixed("ddtree", 8))
    with pytest.raises(UserError, match="'ddtree' needs a drafter"):
        BatchEngine(target, None, ("ddtree",), Fixed("ddtree", 8))
    engine = BatchEngine(target, drafter, ("ddtree",), Fixed("ddtree", 8))
    with pytest.raises(UserError, match="'ddtree' needs a DFlash or TreeFlash drafter"):
        engine.set_drafter(eagle, 1)
    assert engine.drafter is drafter and engine.drafter_version == 0
