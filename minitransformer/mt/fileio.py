"""Atomic file writes: a killed process leaves either the old file or the new one, never half."""
import os
import tempfile


def atomic_write(path, write):
    """Call ``write(fileobj)`` on a temporary file next to ``path``, flush it to disk, then
    rename it over ``path`` (a rename within one directory is atomic)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path, text):
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
