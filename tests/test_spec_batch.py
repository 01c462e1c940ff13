"""Continuous batching: every request's output equals its single-request output, whatever joins or leaves the
batch around it (mixed prompt lengths, staggered arrival, cancellation), greedy and sampled under its seed."""

import json

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.spec.batch import BatchEngine, BatchRequest, Fixed
from trainer.spec.drafting import load_drafter
from trainer.spec.engine import BUILDERS, generate, make_session
from trainer.spec.verify import Sampling


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


@pytest.mark.parametrize("tree,budget", [("none", 0), ("recycling", 16), ("ddtree", 8)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_batched_output_equals_single_request_output(shipped, tree, budget, temperature):
    target, drafter, prompts = shipped
    sampling = Sampling(temperature=temperature)
    references = [
        generate(
            target, make_session(tree, target, drafter), BUILDERS[tree], p, 24, budget, sampling,
            torch.Generator().manual_seed(i),
        ).tokens
        for i, p in enumerate(prompts)
    ]  # fmt: skip
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
    with pytest.raises(ValueError, match="needs"):
        engine.set_adjacency(torch.zeros(17, 4, dtype=torch.long))
    assert torch.equal(engine.recycling.adjacency, newer)
