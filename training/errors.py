"""The one exception type for mistakes a user can fix, and the one guard every entry point (the CLI, `app.py`,
the cost command, the local Slurm, the demo) prints them through: `error:` lines on stderr, no traceback.

Torch-free and CDK-free: the infrastructure side imports it too.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable
from typing import NoReturn


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


def user_error(error: BaseException) -> UserError | None:
    """What a user can fix, as a UserError: the error itself, an operating-system refusal or undecodable text
    (the configuration's validation errors are UserErrors); None for anything else (a bug)."""
    if isinstance(error, UserError):
        return error
    if isinstance(error, OSError):
        return os_error(error)
    if isinstance(error, UnicodeDecodeError):
        return decode_error(error)
    return None


def guarded(run: Callable[[], int], status: int) -> int:
    """The user-error guard of every entry point: run()'s exit status; on a user's mistake its `error:` lines and
    `status` instead. Anything else keeps its traceback."""
    try:
        return run()
    except (UserError, OSError, UnicodeDecodeError) as error:
        found = user_error(error)
        assert found is not None
        report(found)
        return status


class ArgumentParser(argparse.ArgumentParser):
    """argparse's complaints as the other user errors: one `error:` line saying where help is, exit status 2
    (argparse's own); the subcommands' parsers are built from the same class."""

    def error(self, message: str) -> NoReturn:
        report(UserError(f"{message} (see {self.prog} --help)"))
        sys.exit(2)
