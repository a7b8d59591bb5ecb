"""Atomic file writes and up-front checks of output paths.

``atomic_write(path)`` writes into a temporary file in the destination's directory and renames it into
place (``os.replace``) only when the block finishes, so an error or Ctrl-C midway never leaves a
half-written file under the destination's name (the temporary file is removed). The finished file gets
the permissions a plain ``open(path, "w")`` would give it (``0o666`` less the umask), not ``mkstemp``'s
``0o600``. ``output_file_problem`` / ``output_dir_problem`` say why a destination cannot be written,
before any long work starts.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_kwargs):
    """``with atomic_write("x.csv", newline="") as f: ...``: ``f`` is a temporary file next to ``path``;
    on a clean exit it is flushed, synced and renamed to ``path``; on any exception (KeyboardInterrupt
    included) it is deleted and ``path`` is left as it was."""
    if mode not in ("w", "wb", "wt"):
        raise ValueError(f"atomic_write opens files for writing only, not {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be written as a file (its directory missing, not a directory, not writable;
    the path itself a directory), or None when it can."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        return f"{str(path)!r} is not a file name"
    if p.is_dir():
        return f"{p} is a directory"
    d = p.parent
    if not d.exists():
        return f"directory {d} does not exist"
    if not d.is_dir():
        return f"{d} is not a directory"
    if not os.access(d, os.W_OK | os.X_OK):
        return f"directory {d} is not writable"
    if p.exists() and not os.access(p, os.W_OK):
        return f"{p} is not writable"
    return None


def output_dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be used (created if needed) as an output directory, or None when it can."""
    p = Path(path)
    if str(path) == "":
        return "an empty directory name"
    if p.exists():
        if not p.is_dir():
            return f"{p} exists and is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"directory {p} is not writable"
        return None
    base = _nearest_existing(p.absolute().parent)
    if not base.is_dir():
        return f"{base} is not a directory, so {p} cannot be created"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"directory {base} is not writable, so {p} cannot be created"
    return None
