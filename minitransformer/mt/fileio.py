"""Atomic file writes: a killed process leaves either the old file or the new one, never half."""
import errno
import os
import tempfile


def atomic_write(path, write):
    """Call ``write(fileobj)`` on a temporary file next to ``path``, flush it to disk, then
    rename it over ``path`` (a rename within one directory is atomic). The file gets the
    permissions ``open`` would give it (0666 less the umask), not mkstemp's 0600: a run
    directory can be shared, to translate with by another user of its group."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    except OSError as exc:  # (the error names the temporary; a directory gone: said)
        raise naming(exc, path) from exc
    try:
        try:
            os.fchmod(fd, 0o666 & ~umask())
        except OSError as exc:  # a file system without permissions (vfat, some mounts)
            if exc.errno not in (errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and (exc.filename is None or not os.path.isdir(directory)):
            raise naming(exc, path) from exc  # (a failed write or fsync names no file)
        raise


def naming(exc, path):
    """``exc``, an OSError from writing ``path`` (through a temporary, or an open file: it
    names another file or none), as one naming ``path``, and saying so when its directory is
    gone, for the one-line message (``describe_os_error``)."""
    directory = os.path.dirname(os.path.abspath(path))
    what = exc.strerror or str(exc)
    if not os.path.isdir(directory):
        what = f"the directory {directory} was removed ({what})"
    return OSError(exc.errno, what, path)


def umask():
    """This process's umask: read from /proc on Linux, else by setting it and back (which
    another thread creating a file at that moment would see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def atomic_write_text(path, text):
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


# what to do about an OS error on one of the user's paths, by errno
_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free some space, then run again (--resume continues a "
                  "run; the files saved before are intact)",
    errno.EDQUOT: "the disk quota is used up: free some space, then run again",
    errno.EROFS: "the file system is read-only: choose a path on a writable one",
    errno.EACCES: "permission denied: fix the permissions or choose another path",
    errno.EPERM: "not permitted: fix the permissions or choose another path",
    errno.EISDIR: "it is a directory: give a file",
    errno.ENOTDIR: "part of the path is a file, not a directory: give a directory",
    errno.EEXIST: "a file is in the way: give a directory (or remove the file)",
    errno.ENOENT: "no such file or directory",
}


def describe_os_error(exc):
    """One line for an OSError on a user's path: the path, what happened, what to do."""
    where = exc.filename if exc.filename is not None else "a file"
    if exc.filename2 is not None:
        where = f"{where} -> {exc.filename2}"
    hint = _OS_HINTS.get(exc.errno)
    what = exc.strerror or str(exc)
    if hint and hint.startswith(what.lower()):  # (the hint repeats what happened)
        return f"{where}: {what}{hint[len(what):]}"
    if hint and hint in what.lower():  # (said already)
        return f"{where}: {what}"
    return f"{where}: {what}" + (f"; {hint}" if hint else "")
