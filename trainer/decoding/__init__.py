"""Lossless tree speculative decoding as pure tensor functions and per-request sessions; no Lightning.

- ``tree``: trees and the builders that turn drafts into them (DDTree, TreeFlash, retrieval, best subtree).
- ``verify``: tree attention masks, lossless acceptance (greedy and sampled), KV-cache compaction, and
  ``verify_tree``: the step's verify-and-commit core that the single-request loop and the batch engine share.
- ``drafting``: the per-request drafting sessions of each drafter family.
- ``options``: the builders' hyperparameters (``TreeOptions``).
- ``builders``: the registry of tree builders (``BUILDERS``), each family's session and ``make_session``.
- ``events``: what a step reports (``Step``, ``StepEvent`` for the log hook, ``Generation``, the phase clock).
- ``engine``: the single-request decoding loop (``generate``); ``batch``: the continuous-batching engine;
  ``controller``: the cost-aware policy that picks a builder and budget per batch step.

The ``trainer eval`` command that reports on them lives in ``trainer/evaluate.py``.
"""
