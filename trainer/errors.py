"""The one exception type whose message is complete for a user: the CLI prints it without a traceback."""


class UserError(Exception):
    """Bad input (recipe, path, data) described in full: what was wrong, where, and what to do."""
