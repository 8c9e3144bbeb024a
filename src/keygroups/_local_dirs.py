"""Local directories that only this user may change: the read cache and the warm RocksDB databases live on the
executors' disks, often under the shared system temporary directory, and what they hold is read back as state.

:func:`private_directory` creates a directory with mode 0700, or accepts an existing one only when it is a real
directory (not a symlink) owned by this user and writable by no one else; otherwise it warns (logger ``keygroups``)
and hands out a fresh private temporary directory instead, once per process and path. :func:`directory_secret` is a
random key kept in such a directory (mode 0600): what the cache and the warm databases use to seal their contents
with an HMAC, so that a file another process wrote (a local user who got in before the checks, a copy from elsewhere)
is never believed. Every check raises :class:`UnsafeDirectoryError`, which callers turn into "do not use it"."""

from __future__ import annotations

import atexit
import contextlib
import hmac
import logging
import os
import secrets
import shutil
import stat
import tempfile
import threading

log = logging.getLogger("keygroups")

#: Name of the secret file kept in a private directory.
SECRET_NAME = ".keygroups-secret"
_SECRET_BYTES = 32

_lock = threading.Lock()
_resolved: dict[str, str] = {}   # a path asked for -> the directory handed out for it (itself or a fallback)


class UnsafeDirectoryError(OSError):
    """A local directory or file that someone else could have changed: not used."""


def check_private(path: str, *, directory: bool = True) -> os.stat_result:
    """``path``'s status if it is a directory (a regular file when ``directory`` is false) that is no symlink, is
    owned by this user and is writable by neither group nor others; ``UnsafeDirectoryError`` naming what is wrong
    otherwise (``FileNotFoundError`` if it does not exist)."""
    st = os.lstat(path)
    kind = "directory" if directory else "file"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else f"not a {kind}"
        raise UnsafeDirectoryError(f"{path} is {what}; a private {kind} is needed")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                                   "only its owner may write it")
    return st


def make_private(path: str) -> None:
    """Create ``path`` (and missing parents) with mode 0700, or check the existing one and take group and other
    access away from it; UnsafeDirectoryError / OSError when it cannot be made private."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:   # a file, or a dangling symlink, of that name
        raise UnsafeDirectoryError(f"{path} exists and is not a directory") from None
    st = check_private(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def private_directory(path: str | os.PathLike[str], *, what: str) -> str:
    """``path`` as a directory private to this user (see the module docs), or a fresh private temporary directory
    (removed when the process exits) with a warning naming ``what`` it is for and why ``path`` was refused. The
    answer is remembered per process: one check and at most one warning per path."""
    path = os.path.abspath(os.fspath(path))
    with _lock:
        known = _resolved.get(path)
        if known is not None and os.path.isdir(known):
            return known
        try:
            make_private(path)
            chosen = path
        except OSError as e:
            chosen = tempfile.mkdtemp(prefix=f"keygroups-{what.replace(' ', '-')}-")   # mode 0700
            atexit.register(shutil.rmtree, chosen, True)
            log.warning("not using %s as the %s directory (%s); using the private directory %s instead",
                        path, what, e, chosen)
        _resolved[path] = chosen
        return chosen


def directory_secret(directory: str) -> bytes:
    """The random secret kept in private ``directory`` (created on first use, mode 0600; concurrent first uses agree
    on one). UnsafeDirectoryError if the directory or the secret file is not private to this user, OSError if it
    cannot be read or written."""
    check_private(directory)
    path = os.path.join(directory, SECRET_NAME)
    for _ in range(3):
        try:
            check_private(path, directory=False)
            with open(path, "rb") as f:
                secret = f.read()
            if len(secret) == _SECRET_BYTES:
                return secret
            raise UnsafeDirectoryError(f"{path} holds {len(secret)} bytes, not a {_SECRET_BYTES}-byte secret")
        except FileNotFoundError:
            pass
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(_SECRET_BYTES))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)   # never replaces a secret another process made meanwhile
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    raise UnsafeDirectoryError(f"{path}: could not create the directory's secret")


def seal(secret: bytes, *parts: bytes) -> str:
    """An HMAC-SHA256 (hex) of ``parts`` (each length-prefixed, so that no two sequences seal alike) under
    ``secret``."""
    mac = hmac.new(secret, digestmod="sha256")
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def sealed(secret: bytes, mac: str, *parts: bytes) -> bool:
    """Whether ``mac`` is :func:`seal` of ``parts`` under ``secret`` (compared in constant time)."""
    return isinstance(mac, str) and hmac.compare_digest(seal(secret, *parts), mac)


__all__ = ["UnsafeDirectoryError", "check_private", "make_private", "private_directory", "directory_secret", "seal", "sealed",
           "SECRET_NAME"]
