"""``python -m trainer.data.vllm_main COMMAND ARGUMENTS_JSON``: a data job run inside vLLM's environment.

``trainer data regenerate|cache --engine vllm`` started where vLLM is not importable runs itself again here, in
the interpreter of vLLM's environment (:func:`trainer.data.vllm_engine.run_in_vllm_env`), with its arguments as
one JSON object; the job then writes its output and prints its lines exactly as in the main environment. Not
meant to be typed; for a check on CPU::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python \\
        -m trainer.data.vllm_main regenerate '{"target": "checkpoints/target_tiny", "data": ["chats.jsonl"],
        "output": "regen.jsonl", "max_new_tokens": 32, "engine": "vllm"}'
"""

from __future__ import annotations

import json
import sys

from trainer.data.cache import cache_features
from trainer.data.prepare import DataSpec
from trainer.data.regenerate import regenerate
from trainer.data.vllm_engine import vllm_importable
from trainer.errors import UserError


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("regenerate", "cache"):
        raise UserError("usage: python -m trainer.data.vllm_main regenerate|cache ARGUMENTS_JSON")
    command, arguments = argv[0], json.loads(argv[1])
    if not vllm_importable():
        raise UserError(
            f"{sys.executable} cannot import vllm: --vllm_python / $TRAINER_VLLM_PYTHON must be the python of "
            "vLLM's environment (.ci/vllm_env DIR creates one)"
        )
    if command == "regenerate":
        regenerate(**arguments)
    else:
        cache_features(**{**arguments, "spec": DataSpec(**arguments["spec"])})


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"trainer data (vLLM's environment): {e}", file=sys.stderr)
        sys.exit(2)
