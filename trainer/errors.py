"""The one exception type whose message is complete for a user: the CLI prints it without a traceback."""

import argparse


class UserError(Exception):
    """Bad input (recipe, path, data) described in full: what was wrong, where, and what to do."""


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors (unknown option, bad choice or type, missing argument) are UserErrors,
    so a command built on it fails like the rest of the CLI: one line, exit 2, no usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see {self.prog} --help)")
