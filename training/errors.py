"""The one exception type for mistakes a user can fix; the CLI prints it as a single line, no traceback."""


class UserError(Exception):
    """Bad input: the message names what is wrong and what is allowed."""
