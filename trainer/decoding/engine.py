"""The speculative decoding loop: any drafting session with any compatible tree builder, verified losslessly
against an HF causal LM with a KV cache. Plain autoregressive decoding is the same loop with the empty tree,
so the baseline shares every line of overhead with the speculative runs.

One step: the builder asks the session for drafts and returns a tree (timed as ``draft`` for drafter work
and ``tree`` for tree construction); the target verifies the tree in one forward (``verify``); acceptance
walks it (``verify_tree``); the KV cache is compacted to the accepted path and the session is told what was
committed (``commit_verdict``, ``commit``); the request goes on until ``finish_reason`` ends it. Batch size 1;
the batch engine (trainer/decoding/batch.py) verifies, commits and ends each of its rows by the same three
functions. On CPU with the shipped tiny models::

    python -c "
    import torch; from transformers import AutoModelForCausalLM as A
    from trainer.drafters import load_drafter
    from trainer.decoding.builders import BUILDERS, make_session
    from trainer.decoding.engine import generate
    t = A.from_pretrained('checkpoints/target_tiny', dtype=torch.float32).eval()
    s = make_session('ddtree', t, load_drafter('checkpoints/dflash_tiny'))
    g = generate(t, s, BUILDERS['ddtree'], torch.tensor([1, 2, 3]), 32, budget=16)
    print(g.tokens, g.tau)"
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from trainer.decoding.builders import DEFAULT_OPTIONS, TreeBuilder
from trainer.decoding.drafting import DraftSession, commit_verdict
from trainer.decoding.events import Clock, Generation, StepEvent, event_of, step_of
from trainer.decoding.options import TreeOptions
from trainer.decoding.verify import (
    GREEDY,
    Sampling,
    cache_kwarg,
    compact_cache,
    finish_reason,
    growing_cache,
    tree_attention_mask,
    verify_tree,
)
from trainer.target import capture_layers, layer_features


@torch.inference_mode()
def generate(
    target: PreTrainedModel,
    session: DraftSession,
    builder: TreeBuilder,
    prompt: torch.Tensor,
    max_new_tokens: int,
    budget: int,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    stop_token_ids: set[int] | None = None,
    options: TreeOptions = DEFAULT_OPTIONS,
    on_step: Callable[[StepEvent], None] | None = None,
    now: Callable[[], float] = time.perf_counter,
    step_topk: int = 0,
) -> Generation:
    """Decode up to ``max_new_tokens`` after ``prompt`` (Shape: (P,)). Lossless: greedy output equals the
    target's greedy decoding; sampled output is distributed as the target's sampling with ``sampling``.
    ``on_step`` is called after every verification step (timed as the ``log`` phase); it reports the
    verifier's acceptance, which the last step may commit only in part (``max_new_tokens``, stop tokens).
    ``now`` is the clock every time is read from (see :class:`Clock`). ``step_topk``: the width of
    ``StepEvent.top_ids`` (0: none), found by greedy verification in its own pass over the logits, so that a hook
    logging each row's top-k (the verifier log's width) need not pass over them again."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    device = target.device
    stops = stop_token_ids or set()
    cache = growing_cache(target.config)
    cache_kw = cache_kwarg(target)
    dtype = next(target.parameters()).dtype
    clock = Clock(device, now)

    start = clock.now()
    prompt = prompt.to(device)
    with capture_layers(target, session.layer_ids) as states:
        out = target(
            input_ids=prompt[None],
            use_cache=True,
            logits_to_keep=0 if session.needs_prompt_logits else 1,
            **{cache_kw: cache},
        )
    logits = out.logits[0].float()
    tokens = [sampling.next_token(logits[-1], generator)]
    session.start(prompt, layer_features(states, session.layer_ids, (0,)), logits)
    generation = Generation(tokens)
    generation.prefill_seconds = clock.now() - start

    start = clock.now()
    past_len = prompt.numel()
    while finish_reason(tokens, max_new_tokens, stops) is None:
        remaining = max_new_tokens - len(tokens)
        clock.seconds = {}
        forwards = session.forwards
        root = tokens[-1]
        tree = builder.build(session, root, budget, remaining, clock, options)
        with clock("verify"):
            depths = tree.depths()
            positions = (past_len + depths).to(device)
            with capture_layers(target, session.layer_ids) as states:
                out = target(
                    input_ids=tree.tokens[None].to(device),
                    position_ids=positions[None],
                    # A chain sees the prefix and itself causally: the model's own causal mask, cheaper than ours.
                    attention_mask=None if tree.is_chain else tree_attention_mask(tree, past_len, dtype, device),
                    use_cache=True,
                    **{cache_kw: cache},
                )
            logits = out.logits[0].float()
            verdict = verify_tree(tree, logits, sampling, generator, remaining, stops, step_topk if on_step else 0)
        with clock("commit"):
            path = verdict.path
            compact_cache(cache, past_len, path)
            # A chain's path is a prefix of the tree: a slice of the hidden states, not a gather.
            rows = slice(len(path)) if path[-1] == len(path) - 1 else torch.tensor(path, device=device)
            features = {session.layer_ids: layer_features(states, session.layer_ids, (0, rows))}
            commit_verdict(verdict, tokens, (session,), features, tree, logits)
        if on_step is not None:
            with clock("log"):
                on_step(event_of(len(generation.steps), past_len, tree, verdict, logits, clock.seconds, budget,
                                 builder.name))  # fmt: skip
        past_len += len(path)
        generation.steps.append(step_of(verdict, tree, int(depths.max()), session.forwards - forwards, clock.seconds))
    generation.decode_seconds = clock.now() - start
    return generation
