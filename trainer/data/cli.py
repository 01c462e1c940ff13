"""``trainer data``: data preparation jobs. The functions' typed signatures are the schema and the help."""

from __future__ import annotations

from jsonargparse import CLI

from trainer.data.cache import cache_features
from trainer.data.regenerate import regenerate

COMMANDS = {"cache": cache_features, "regenerate": regenerate}


def main(argv: list[str]) -> None:
    CLI(COMMANDS, args=argv, as_positional=False)
