"""Output directories that are either complete or absent, safe on storage shared by several machines.

Every command writes into a hidden temporary sibling and renames it into place at the end, with a
`manifest.json` describing what it did. A rerun with the same inputs finds that manifest and reuses the
output. Small files that runs keep rewriting (a run's record and job scripts, the samples) are replaced
in one rename too (`write_file`), without a manifest. The outputs live on FSx for Lustre, mounted on
every cluster node, so what a run leaves beside an output may belong to a process on another machine.
The rules:

- Ownership. Every hidden sibling (`.NAME.tmp-OWNER` being written, `.NAME.old-OWNER` set aside while
  replacing, `.NAME.scratch-OWNER` for intermediate files) carries its writer in its name: host name,
  a digest of the boot id and pid namespace (the process table the pid belongs to), pid, the process's
  start time (clock ticks since boot, from /proc) and a random per-process token. The name is the record,
  so it exists from the instant the directory does: there is no moment when a sibling has no owner.
- Cleanup removes a sibling only when its writer is provably gone: it was written from this very
  process table and that pid no longer exists, is a zombie, or now belongs to another process (another
  start time, or our own pid with another token). A sibling written on another machine is never
  removed, whatever its age: from here nothing tells a dead writer from one that is slow, suspended or
  cut off, and a lease would remove the directory under any writer stalled longer than the lease (a
  suspended job, a hung mount). It is kept with a warning naming it, to delete by hand once that run is
  gone; a rerun on the machine that wrote it, before it reboots, removes it by itself.
- Replacing. `--overwrite` replaces only an output of this tool (a directory whose manifest has a kind
  and a fingerprint) or an empty directory; anything else is refused. Where the file system can swap two
  directories in one step (renameat2's RENAME_EXCHANGE: ext4, XFS, Btrfs, tmpfs), the new output and the
  old one trade names, so a reader always finds a complete `NAME`, and the old one, now under the
  temporary name, is deleted. Elsewhere (a file system that refuses the flag, Lustre among them unless
  it supports it) the old output is renamed to `.NAME.old-OWNER`, the new one into place, then the old
  one is deleted; a reader that opens `NAME` in the instant between the renames finds it missing (the
  complete old copy is then at `.NAME.old-OWNER`). A run killed between the two renames leaves no `NAME`
  but a complete copy set aside: the next run restores it before anything else, so after any kill and a
  rerun there is exactly one complete output and nothing hidden beside it.
- Concurrent writers are arbitrated by rename(2), not by a lock: renaming a directory onto a non-empty
  directory fails, so of writers racing to publish exactly one succeeds. The others find its manifest:
  made from the same inputs, they keep it and succeed (the loser's work is discarded); from other
  inputs, they stop with the usual one-line refusal unless `--overwrite`, when the last one wins. A lock
  file would stop a second writer earlier, but a lock left by a killed run on another machine could
  then never be broken safely; rename(2) leaves nothing to break.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeGuard

from training.errors import UserError

MANIFEST = "manifest.json"
KINDS = ("tmp", "old", "scratch")
# Fault injection for the kill tests: SIGKILL this process at the named point of publishing an output
# (before-rename, between-renames: only when replacing, after-rename) or of submitting a run
# (submitted-STAGE: after that stage's sbatch, before run.json records it) or of exporting to S3
# (uploaded-N: after N objects). Unset in production.
KILL_AT = "TRAINING_OUTPUTS_KILL_AT"
# "0": replace with two renames even where the file system could swap (the kill tests cover both ways).
EXCHANGE = "TRAINING_OUTPUTS_EXCHANGE"
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100  # <linux/fs.h>, <fcntl.h>
PUBLISH_ATTEMPTS = 5  # rounds of losing a rename race to other writers before giving up

State = Literal["absent", "empty", "ours", "foreign"]
log = logging.getLogger(__name__)
_TOKEN = secrets.token_hex(4)
_FILLED = (errno.ENOTEMPTY, errno.EEXIST)  # rename(2) onto a directory that is not empty
_OWNER = re.compile(
    r"(?P<host>[A-Za-z0-9._-]+)-(?P<machine>[0-9a-f]{12})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-(?P<token>[0-9a-f]{8})"
)


@dataclass(frozen=True)
class Owner:
    """Who wrote a hidden sibling; `machine` equal means the pid is one of this process table's."""

    host: str
    machine: str
    pid: int
    start: int  # process start time in clock ticks since boot; 0 when unknown
    token: str

    def tag(self) -> str:
        return f"{self.host}-{self.machine}-{self.pid}-{self.start}-{self.token}"


def current_owner() -> Owner:
    host, machine = _machine()
    pid = os.getpid()
    return Owner(host, machine, pid, process_start(pid) or 0, _TOKEN)


def sibling_name(final_name: str, kind: str, owner: Owner) -> str:
    return f".{final_name}.{kind}-{owner.tag()}"


def parse_sibling(final_name: str, name: str) -> tuple[str, Owner | None] | None:
    """(kind, owner) of a hidden sibling of `final_name`; owner None when the name does not record one
    (an earlier version of this tool named them by pid only). None for any other name."""
    prefix = f".{final_name}."
    kind, dash, rest = name.removeprefix(prefix).partition("-")
    if not name.startswith(prefix) or not dash or kind not in KINDS:
        return None
    match = _OWNER.fullmatch(rest)
    if match is None:
        return kind, None
    return kind, Owner(match["host"], match["machine"], int(match["pid"]), int(match["start"]), match["token"])


def owner_is_gone(owner: Owner, me: Owner, start_of: Callable[[int], int | None]) -> bool:
    """True only when provable from here; `start_of(pid)` is a live pid's start time (0 if unknown), or
    None when no such process is running."""
    if (owner.host, owner.machine) != (me.host, me.machine):
        return False
    if owner.pid == me.pid:
        return owner.token != me.token
    start = start_of(owner.pid)
    if start is None:
        return True
    return owner.start != 0 and start != 0 and start != owner.start


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((directory / MANIFEST).read_text()))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def output_state(final: Path) -> State:
    """What `final` is now; only "absent", "empty" and "ours" may be written over."""
    if not os.path.lexists(final):
        return "absent"
    if final.is_symlink() or not final.is_dir():
        return "foreign"
    if _is_ours(read_manifest(final)):
        return "ours"
    with os.scandir(final) as entries:
        return "empty" if next(entries, None) is None else "foreign"


def reusable(final: Path, fingerprint: dict[str, Any], *, overwrite: bool) -> dict[str, Any] | None:
    """The manifest of a completed output made from the same inputs, or None if it must be (re)built.

    Leftovers of killed runs are dealt with first, so a copy set aside by a killed replacement is back
    in place before it is judged."""
    recover(final.absolute())
    manifest = read_manifest(final)
    if _is_ours(manifest) and manifest["fingerprint"] == fingerprint:
        return manifest
    state = output_state(final)
    if state in ("absent", "empty"):
        return None
    if state == "foreign":
        raise UserError(_foreign(final))
    if overwrite:
        return None
    raise UserError(_different_inputs(final, fingerprint, manifest))


def recover(final: Path, *, warn: bool = True) -> None:
    """Restore a complete copy that a killed replacement set aside when `final` is missing, and remove
    the other leftovers of writers that are provably gone; keep everything else."""
    me = current_owner()
    for path, kind, owner in sorted(_siblings(final), key=lambda sibling: sibling[1] != "old"):
        if owner is None or not owner_is_gone(owner, me, process_start):
            if warn:
                _warn_kept(path, owner, me)
            continue
        if kind == "old" and output_state(final) in ("absent", "empty") and _moved(path, final, *_FILLED, errno.ENOENT):
            log.warning(f"{final}: restored the complete copy that a killed run had set aside")
            continue
        if kind == "old" and output_state(final) == "foreign":
            if warn:
                log.warning(f"kept {path}: a complete output set aside by a killed run; {final} holds something else")
            continue
        _remove(path)


@contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success it is published as `final` (replacing an output of
    this tool only when `overwrite`), on failure it is removed."""
    final = final.absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    recover(final, warn=False)
    temporary = final.parent / sibling_name(final.name, "tmp", current_owner())
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        _publish(temporary, final, overwrite=overwrite)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # gone already once published


@contextmanager
def scratch_directory(final: Path) -> Iterator[Path]:
    """A hidden sibling for intermediate files, removed afterwards whatever happens."""
    final = final.absolute()
    scratch = final.parent / sibling_name(final.name, "scratch", current_owner())
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def files_fingerprint(root: Path, relatives: list[Path]) -> dict[str, Any]:
    """What an output was made from: these files under `root`, by name, size and modification time (cheap
    on multi-GB models; any rewrite changes the modification time)."""
    digest = hashlib.sha256()
    for relative in relatives:
        stat = (root / relative).stat()
        digest.update(f"{relative.as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"directory": str(root.resolve()), "files": len(relatives), "sha256": digest.hexdigest()}


def write_file(final: Path, content: str | bytes, *, kill_at: str = "before-rename") -> None:
    """Replace a small file in one rename, so a reader finds the old content or the new, never a part of it.
    A kill leaves the hidden `.NAME.tmp-OWNER` beside it, removed by the next write once its writer is
    provably gone (the same rules as for directories). `kill_at` names the kill point before the rename: a file
    written inside a command whose own renames the kill tests stop at takes a name of its own."""
    final = final.absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    recover(final, warn=False)
    temporary = final.parent / sibling_name(final.name, "tmp", current_owner())
    try:
        if isinstance(content, bytes):
            temporary.write_bytes(content)
        else:
            temporary.write_text(content, encoding="utf-8")
        kill_point(kill_at)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(temporary: Path, final: Path, *, overwrite: bool) -> None:
    """Rename the finished `temporary` into place; a lost race re-reads what the winner published."""
    fingerprint = (read_manifest(temporary) or {}).get("fingerprint")
    for _ in range(PUBLISH_ATTEMPTS):
        state = output_state(final)
        if state in ("absent", "empty"):
            kill_point("before-rename")
            if _moved(temporary, final, *_FILLED):
                kill_point("after-rename")
                return
            continue
        if state == "foreign":
            raise UserError(_foreign(final))
        existing = read_manifest(final) or {}
        if existing.get("fingerprint") == fingerprint:
            log.info(f"{final} was written meanwhile by another run from the same inputs; keeping it")
            return
        if not overwrite:
            raise UserError(_different_inputs(final, fingerprint or {}, existing))
        kill_point("before-rename")
        if _exchanged(temporary, final):
            kill_point("after-rename")
            shutil.rmtree(temporary, ignore_errors=True)  # the previous output, under the temporary name now
            return
        retired = final.parent / sibling_name(final.name, "old", current_owner())
        if not _moved(final, retired, errno.ENOENT):  # another run is replacing it right now
            continue
        kill_point("between-renames")
        try:
            published = _moved(temporary, final, *_FILLED)
        except OSError:
            _moved(retired, final, *_FILLED, errno.ENOENT)  # put the old output back before giving up
            raise
        if published:
            kill_point("after-rename")
        shutil.rmtree(retired, ignore_errors=True)
        if published:
            return
    raise UserError(f"{final}: other runs kept replacing it while this one tried to; rerun once they are done")


def _exchanged(first: Path, second: Path) -> bool:
    """Swap two directories' names in one step (renameat2 with RENAME_EXCHANGE); False where the C library
    or the file system cannot, or the swap is switched off."""
    if os.environ.get(EXCHANGE) == "0":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOENT):
        return False  # no such swap here, or the output vanished meanwhile: the two-rename path decides
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def _moved(source: Path, target: Path, *lost: int) -> bool:
    """rename(2); False on the errors in `lost`, those by which another process shows it got there first."""
    try:
        source.rename(target)
    except OSError as error:
        if error.errno in lost:
            return False
        raise
    return True


def _siblings(final: Path) -> Iterator[tuple[Path, str, Owner | None]]:
    try:
        names = os.listdir(final.parent)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        if (parsed := parse_sibling(final.name, name)) is not None:
            yield final.parent / name, *parsed


def _warn_kept(path: Path, owner: Owner | None, me: Owner) -> None:
    """Leftovers nobody here can judge stay until removed by hand; say so (a live writer here is silent)."""
    if owner is None:
        log.warning(f"kept {path}: its writer is not recorded in its name; delete it once no run writes there")
    elif (owner.host, owner.machine) != (me.host, me.machine):
        log.warning(
            f"kept {path}: written by pid {owner.pid} on {owner.host}, which cannot be checked from {me.host}; "
            "delete it once that run is gone"
        )


def _is_ours(manifest: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return manifest is not None and "kind" in manifest and "fingerprint" in manifest


def _foreign(final: Path) -> str:
    return (
        f"{final} already exists and was not written by this tool; choose another --output "
        "(--overwrite replaces only this tool's outputs and empty directories)"
    )


def _different_inputs(final: Path, fingerprint: dict[str, Any], manifest: dict[str, Any] | None) -> str:
    recorded = (manifest or {}).get("fingerprint", {})
    differing = sorted(key for key in fingerprint.keys() | recorded.keys() if fingerprint.get(key) != recorded.get(key))
    return (
        f"{final} already holds an output made with different inputs ({', '.join(differing)}); "
        "choose another --output or pass --overwrite"
    )


def kill_point(point: str) -> None:
    """Fault injection for the kill tests (see KILL_AT)."""
    if os.environ.get(KILL_AT) == point:
        os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _machine() -> tuple[str, str]:
    """This host's name as it may appear in a file name, and a digest of what makes its pids meaningful:
    the boot (pids restart) and the pid namespace (containers have their own)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return host, hashlib.sha256(f"{boot}\n{namespace}".encode()).hexdigest()[:12]


def process_start(pid: int) -> int | None:
    """The start time of a running process (0 when it cannot be read), None when there is none."""
    if pid <= 0:
        return 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0  # no /proc here, or hidden from this user
    if fields[0] in ("Z", "X"):
        return None  # exited, not yet reaped
    return int(fields[19])
