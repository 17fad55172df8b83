"""The one exception type for mistakes a user can fix; the CLI prints it as `error:` lines, no traceback."""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input: the message names what is wrong and what is allowed (one line per problem)."""


def report(error: UserError) -> None:
    """Each problem on its own `error: ...` line on stderr."""
    for line in str(error).splitlines() or [""]:
        print(f"error: {line}", file=sys.stderr)
