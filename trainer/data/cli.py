"""``trainer data``: data preparation jobs. The functions' typed signatures are the schema and the help."""

from __future__ import annotations

from jsonargparse import CLI

from trainer.data.cache import cache_features
from trainer.data.regenerate import regenerate
from trainer.recipes import join_list_values, list_keys

COMMANDS = {"cache": cache_features, "regenerate": regenerate}


def main(argv: list[str]) -> None:
    """``trainer data COMMAND ...``; a list argument takes one value, several, or a list (``--data a b``,
    ``--data a``, ``--data '[a, b]'``)."""
    if argv and argv[0] in COMMANDS:
        argv = [argv[0], *join_list_values(argv[1:], list_keys(COMMANDS[argv[0]]))]
    CLI(COMMANDS, args=argv, as_positional=False)
