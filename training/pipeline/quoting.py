"""Values rendered into job scripts: quoted for the shell, or checked where Slurm parses them itself."""

from __future__ import annotations

import re
import shlex
from typing import Any

from training.config.loading import has_control_characters

# What Slurm's own parser of `#SBATCH` lines would split, unquote, end as a comment or expand (`%j` in a log
# path): such a value cannot be quoted for the shell there, so it is refused instead.
SBATCH_UNSAFE = re.compile(r"[\s'\"\\#%\x00-\x1f\x7f]")


def shell_word(value: Any) -> str:
    """Jinja2 filter `shell`: one value as one shell word. A control character cannot have got this far (the
    settings refuse them when they are read); here it would be a bug, so it fails loudly."""
    text = str(value)
    if has_control_characters(text):
        raise ValueError(f"control character in a value rendered into a job script: {text!r}")
    return shlex.quote(text)


def sbatch_value(value: Any) -> str:
    """Jinja2 filter `sbatch`: a value of an `#SBATCH` line, which Slurm parses itself and the shell never
    sees, so it is checked instead of quoted (runs_root, the run id and the partitions are refused earlier)."""
    text = str(value)
    if SBATCH_UNSAFE.search(text):
        raise ValueError(f"#SBATCH value that Slurm would split or reinterpret: {text!r}")
    return text


def code_line(value: Any) -> str:
    """Jinja2 filter `line`: a line of shell code written as it is (the site file's `setup`), which must stay one
    line."""
    text = str(value)
    if has_control_characters(text):
        raise ValueError(f"control character in a line of shell code: {text!r}")
    return text
