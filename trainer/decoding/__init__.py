"""Lossless tree speculative decoding as pure tensor functions and per-request sessions; no Lightning.

- ``tree``: trees and the builders that turn drafts into them (DDTree, TreeFlash, retrieval, best subtree).
- ``verify``: tree attention masks, lossless acceptance (greedy and sampled), KV-cache compaction.
- ``drafting``: the per-request drafting sessions of each drafter family, and ``load_drafter``.
- ``options``: the builders' hyperparameters (``TreeOptions``).
- ``engine``: the decoding loop that joins them, and the registry of builders.

The ``trainer eval`` command that reports on them lives in ``trainer/evaluate.py``.
"""
