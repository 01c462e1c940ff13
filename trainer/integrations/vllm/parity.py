"""Export parity gate: vLLM serves an export of a drafter; its per-position acceptance is printed beside our engine's
for the same drafter and chain length, and both outputs beside plain decoding (fp32, greedy: all must be equal).

vLLM verifies chains: EAGLE-3 drafts ``--tokens`` deep (our ``eagle`` builder with one candidate per depth), a
SpecBlock export SpecBlock's chain of ``--tokens`` (:mod:`trainer.integrations.vllm.specblock`; our
``specblock-chain`` builder),
DFlash a block of ``block_size - 1`` (our ``chain`` builder). A TreeFlash drafter's ``treeflash`` export drafts
TreeFlash's chain of that block (:mod:`trainer.integrations.vllm.treeflash`; our ``treeflash-chain`` builder); its
``dflash`` export is its backbone, its AR-approximator dropped, compared with our engine drafting with the
backbone. Runs in vLLM's environment (``.ci/vllm_env``), one vLLM engine per format, in process; exits 1 on any
difference::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m trainer.integrations.vllm.parity \\
        --drafter checkpoints/eagle3_tiny --formats speculators --limit 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.decoding.options import TreeOptions
from trainer.drafters.families import family_of
from trainer.errors import ArgumentParser, UserError
from trainer.evaluate import read_prompts
from trainer.export import formats_for, write_export
from trainer.export.dflash import as_dflash
from trainer.export.source import load_source
from trainer.paths import project_path

DEFAULT_PROMPTS = "data/prompts/stdlib_heldout.jsonl"
# KV cache of one in-process engine: ample for a few short prompts, small beside other processes' memory.
KV_CACHE_BYTES = 256 << 20
MIN_MODEL_LEN = 512


@dataclass
class ChainAcceptance:
    """Drafting steps (those that verified at least one draft) and how many accepted position j + 1 or deeper."""

    drafts: int
    draft_tokens: int
    per_position: list[int]

    @property
    def accepted(self) -> int:
        return sum(self.per_position)


def ours(
    target: PreTrainedModel, drafter: PreTrainedModel, prompts: list[list[int]], tokens: int, max_tokens: int
) -> tuple[list[list[int]], ChainAcceptance]:
    """Our engine drafting the chain vLLM drafts: EAGLE-3 ``tokens`` deep with one candidate per depth, DFlash its
    ``chain`` of ``tokens``, TreeFlash its ``treeflash-chain``, SpecBlock its ``specblock-chain``.

    vLLM drafts the full chain at every step, the last ones included, and counts what it accepted before trimming
    the output to ``max_tokens``; our engine shortens the chain to the tokens still wanted. So ours decodes
    ``tokens`` further and counts the steps that started before ``max_tokens`` (the steps vLLM ran)."""
    if family_of(drafter).name == "specblock":
        tree, options = "specblock-chain", TreeOptions()
    elif family_of(drafter).vllm_method == "eagle3":
        tree, options = "eagle", TreeOptions(eagle_top_k=1, eagle_depth=tokens)
    elif family_of(drafter).approximator is not None:
        tree, options = "treeflash-chain", TreeOptions()
    else:
        tree, options = "chain", TreeOptions()
    outputs, per_position, drafts, draft_tokens = [], [0] * tokens, 0, 0
    for prompt in prompts:
        session = make_session(tree, target, drafter, options)
        prompt_ids = torch.tensor(prompt)
        g = generate(target, session, BUILDERS[tree], prompt_ids, max_tokens + tokens, tokens, options=options)
        outputs.append(g.tokens[:max_tokens])
        done = 1  # the prefill's token
        for step in g.steps:
            if done >= max_tokens:
                break
            done += step.committed
            if step.tree_size > 0:
                drafts += 1
                draft_tokens += step.tree_size
                for j in range(step.accepted):
                    per_position[j] += 1
    return outputs, ChainAcceptance(drafts, draft_tokens, per_position)


def plain(target: PreTrainedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's own greedy decoding (the engine's drafter-free loop)."""
    session = make_session("none", target, None)
    return [generate(target, session, BUILDERS["none"], torch.tensor(p), max_tokens, 0).tokens for p in prompts]


def _metric(metrics: list, name: str) -> list[int]:
    found = [m for m in metrics if m.name == name]
    if not found:
        raise UserError(f"vLLM reported no {name}; is speculative decoding on?")
    metric = found[0]
    return [int(v) for v in metric.values] if hasattr(metric, "values") else [int(metric.value)]


def served(
    target: Path, export: Path, method: str, tokens: int, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], ChainAcceptance]:
    """vLLM (in this process) serving ``export`` beside ``target``, greedy, fp32: outputs and acceptance counts
    from vLLM's own metrics."""
    from vllm import LLM, SamplingParams

    spec = {"model": str(export), "method": method, "num_speculative_tokens": tokens}
    llm = LLM(
        str(target),
        dtype="float32",
        speculative_config=spec,
        enforce_eager=True,
        # Room beyond the longest request: at a max_model_len just above it (188 for the shipped prompts) vLLM
        # 0.32.0's DFlash drafts differently (some blocks all token 0) and accepts less; from 256 on it agrees.
        max_model_len=max(MIN_MODEL_LEN, 2 * (max(len(p) for p in prompts) + max_tokens + tokens + 1)),
        async_scheduling=False,
        # A SpecBlock drafter refuses vLLM's prefix cache (trainer.integrations.vllm.specblock); every format runs
        # without it alike (the prompts share no cached prefix either way).
        enable_prefix_caching=False,
        disable_log_stats=False,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs = [list(r.outputs[0].token_ids) for r in results]
        metrics = llm.get_metrics()
        acceptance = ChainAcceptance(
            _metric(metrics, "vllm:spec_decode_num_drafts")[0],
            _metric(metrics, "vllm:spec_decode_num_draft_tokens")[0],
            _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos"),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return outputs, acceptance


def method_of(drafter: PreTrainedModel) -> str:
    """The speculative method vLLM serves ``drafter``'s export with."""
    method = family_of(drafter).vllm_method
    if method is None:
        raise UserError(f"vLLM has no drafter of a {type(drafter).__name__}")
    return method


def chain_length(drafter: PreTrainedModel, tokens: int | None) -> int:
    """EAGLE-3: ``tokens`` (default 3); SpecBlock: ``tokens`` (default its block); DFlash: its block less the root,
    which vLLM drafts whole."""
    if family_of(drafter).name == "specblock":
        return tokens or drafter.block_size
    if method_of(drafter) == "eagle3":
        return tokens or 3
    block = as_dflash(drafter).block_size - 1
    if tokens not in (None, block):
        raise UserError(f"a DFlash drafter drafts its block of {block} tokens in vLLM; --tokens {tokens} differs")
    return block


def check(
    drafter_path: Path, target_path: Path, formats: list[str], prompts: list[list[int]], max_tokens: int,
    tokens: int | None = None, served_dir: Path | None = None,
) -> list[dict]:  # fmt: skip
    """One row per format: ours vs vLLM, and whether outputs equal plain decoding. ``served_dir``: an export
    already written (one format) for vLLM to serve, instead of a fresh one."""
    drafter = load_source(Path(drafter_path)).drafter
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    k = chain_length(drafter, tokens)
    reference = plain(target, prompts, max_tokens)
    # Ours per drafter vLLM serves: a TreeFlash drafter's ``treeflash`` export is itself, any other of its exports
    # its DFlash backbone.
    drafted: dict[bool, tuple[list[list[int]], ChainAcceptance]] = {}
    rows = []
    for fmt in formats:
        if fmt not in formats_for(drafter):
            raise UserError(f"{drafter_path} does not export as {fmt}; it exports as {', '.join(formats_for(drafter))}")
        served_as = family_of(drafter).approximator is not None and fmt != "treeflash"
        if served_as not in drafted:
            drafted[served_as] = ours(target, as_dflash(drafter) if served_as else drafter, prompts, k, max_tokens)
        our_outputs, our_counts = drafted[served_as]
        with tempfile.TemporaryDirectory() as tmp:
            export = served_dir or write_export(drafter, fmt, Path(tmp) / fmt, str(target_path))
            vllm_outputs, vllm_counts = served(target_path, export, method_of(drafter), k, prompts, max_tokens)
        rows.append(
            {
                "format": fmt,
                "served_as": "dflash (approximator dropped)" if served_as else None,
                "tokens": k,
                "ours": asdict(our_counts),
                "vllm": asdict(vllm_counts),
                "ours_equal_plain": our_outputs == reference,
                "vllm_equal_plain": vllm_outputs == reference,
            }
        )
    return rows


def passed(row: dict) -> bool:
    return row["ours"] == row["vllm"] and row["ours_equal_plain"] and row["vllm_equal_plain"]


def table(rows: list[dict]) -> str:
    lines = ["| format | k | drafts ours / vLLM | accepted per position ours | vLLM | outputs = plain | verdict |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        o, v = r["ours"], r["vllm"]
        name = r["format"] + (f" (served as {r['served_as']})" if r["served_as"] else "")
        lines.append(
            f"| {name} | {r['tokens']} | {o['drafts']} / {v['drafts']} | {o['per_position']} | {v['per_position']} "
            f"| ours {r['ours_equal_plain']}, vLLM {r['vllm_equal_plain']} | {'equal' if passed(r) else 'DIFFERENT'} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m trainer.integrations.vllm.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=Path, required=True, help="run directory, .ckpt or HF drafter directory")
    parser.add_argument("--target", type=Path, default=Path("checkpoints/target_tiny"), help="HF target directory")
    parser.add_argument("--formats", required=True, help="comma-separated export formats to serve")
    parser.add_argument("--prompts", type=Path, default=Path(DEFAULT_PROMPTS), help='JSONL of {"id", "prompt"}')
    parser.add_argument("--limit", type=int, default=8, help="first N prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, help="EAGLE-3 chain length (default 3); DFlash drafts its block")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--export", type=Path, help="serve this export (of the one format given) instead of a new one")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise UserError("run the gate with VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM's engine in this process)")
    target = project_path(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = read_prompts(project_path(args.prompts))[: args.limit]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    formats = args.formats.split(",")
    if args.export is not None and len(formats) != 1:
        raise UserError(f"--export {args.export} is one format's directory; give one --formats, not {formats}")
    result = check(args.drafter, target, formats, prompts, args.max_tokens, args.tokens, args.export)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if all(passed(r) for r in result) else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
