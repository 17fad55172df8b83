"""The one exception type for mistakes a user can fix; the CLI prints it as `error:` lines, no traceback."""

from __future__ import annotations

import errno
import sys


class UserError(Exception):
    """Bad input: the message names what is wrong and what is allowed (one line per problem)."""


def report(error: UserError) -> None:
    """Each problem on its own `error: ...` line on stderr."""
    for line in str(error).splitlines() or [""]:
        print(f"error: {line}", file=sys.stderr)


# What a user can do about the operating system's refusals that bad paths and full disks cause.
_OS_ADVICE = {
    errno.ENOSPC: "free space there or choose another location",
    errno.EDQUOT: "free space there or choose another location",
    errno.EROFS: "a writable location",
    errno.EACCES: "a location this user may read and write",
    errno.EPERM: "a location this user may read and write",
    errno.ENOTDIR: "a path whose parents are directories, not files",
    errno.EEXIST: "a path whose parents are directories, not files",
    errno.EISDIR: "a file here, not a directory",
    errno.ENOENT: "an existing path",
    errno.ENAMETOOLONG: "a shorter path",
}


def os_error(error: OSError) -> UserError:
    """An operating-system refusal (permissions, read-only or full file system, a file where a directory is
    needed) as one line: the path, the reason, and what would work."""
    paths = " -> ".join(str(p) for p in (error.filename, error.filename2) if p is not None)
    reason = (error.strerror or str(error)).splitlines()[0] if (error.strerror or str(error)) else type(error).__name__
    advice = _OS_ADVICE.get(error.errno or 0)
    message = f"{paths}: {reason}" if paths else reason
    return UserError(f"{message}; allowed: {advice}" if advice else message)


def decode_error(error: UnicodeDecodeError) -> UserError:
    """Text input that is not UTF-8, where no reader named the file itself."""
    return UserError(f"input is not UTF-8 text ({error.reason} at byte {error.start}); allowed: UTF-8 files")
