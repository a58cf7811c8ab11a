"""kiln's private directories and the files in them.

Everything kiln writes lives in directories ``directory`` checked: made with mode 0700, or existing and
this user's, writable by nobody else, in a parent others cannot rename it out of (sticky when writable by
all) and taking a new file; else ``DirRefused`` says why and how to fix it. Files are written under a fresh
random name (created exclusively) and renamed into place; a built library or a cache entry is loaded only
when its HMAC under the directory's key (``secret``) verifies, so a file someone else wrote is never run.
"""
import atexit
import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
import warnings

from kiln.debug import log
from kiln.options import UserError

PREFIX = "kiln_"
KEY_FILE = "kiln_secret.key"
_LOCK = threading.Lock()
_CHECKED: dict = {}   # path -> its (dev, inode, mode, uid) when it passed the checks
_KEYS: dict = {}      # directory -> its key
_WARNED: set = set()
_TEMP: list = []      # this process's fallback directory, once made


class DirRefused(RuntimeError, UserError):
    """A directory kiln would write to or load from is not private to this user (another user's, writable
    by others, in a parent anyone may rename it out of) or takes no file (read-only); the message names
    the option or environment variable that chooses it and how to fix it."""


def user_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``, joined with ``parts``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln", *parts)


def directory(path, how: str) -> str:
    """``path`` made absolute, created with mode 0700 when missing, checked; ``how`` names the option or
    variable that chose it (for the message). Raises ``DirRefused``, or OSError when it cannot be made."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    seen = (st.st_dev, st.st_ino, st.st_mode, st.st_uid)
    if _CHECKED.get(path) == seen:
        return path
    why = _unsafe(path, st)
    if why:
        raise DirRefused(f"{path} {why}; kiln writes and loads nothing there. Fix: {_fix(why, path, how)}")
    _CHECKED[path] = seen
    return path


def _unsafe(path: str, st) -> str:
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {oct(st.st_mode & 0o777)})"
    parent = os.path.dirname(path)
    pst = os.stat(parent)
    if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
        return f"lies in {parent}, which anyone may write to (mode {oct(pst.st_mode & 0o777)}, no sticky bit)"
    try:   # read-only (a mount, a mode): a new file says it, for root too
        fd, probe = tempfile.mkstemp(prefix=PREFIX, suffix=".tmp", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"takes no new file ({e.strerror or e})"
    return ""


def _fix(why: str, path: str, how: str) -> str:
    own = f"set {how} to a {'writable ' if why.startswith('takes no') else ''}directory of your own"
    return f"chmod 700 {path}, or {own}" if why.startswith("is writable by") else own


def fallback(what: str, error: Exception, how: str) -> str:
    """A directory of this process's own (``mkdtemp``, removed at exit) in place of a refused or unusable one
    (``how``: the option choosing it); warns once per ``what`` and reason."""
    fix = "" if isinstance(error, DirRefused) else f"; set {how} to a writable directory of your own"
    message = f"kiln: {what}: {error}{fix}"
    warn_once(f"{message} (using a private temporary directory for this process)", stacklevel=4)
    with _LOCK:
        if not _TEMP:
            _TEMP.append(tempfile.mkdtemp(prefix=PREFIX))
            atexit.register(shutil.rmtree, _TEMP[0], True)
        log(2, f"private: {what} refused ({error}); using {_TEMP[0]}")
        return _TEMP[0]


def warn_once(message: str, stacklevel: int = 3, category=UserWarning) -> None:
    with _LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    warnings.warn(message, category, stacklevel=stacklevel)


def write(directory_: str, name: str, data, sync: bool = False) -> str:
    """Write ``data`` (bytes or str) to ``directory_/name`` atomically: a new ``kiln_*.tmp`` file (made
    exclusively, mode 0600) renamed over ``name`` (a link there is replaced, never followed)."""
    if os.path.basename(name) != name or not name:
        raise ValueError(f"private.write: {name!r} is not a file name")
    fd, tmp = tempfile.mkstemp(prefix=PREFIX, suffix=".tmp", dir=directory_)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        path = os.path.join(directory_, name)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    return path


def read(path: str) -> bytes:
    """The bytes of regular file ``path``, not through a link (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read()


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def remove_stale(directory_: str, age_s: float = 3600.0) -> int:
    """Delete the temporary files (``kiln_*.tmp``) older than ``age_s`` (their writer died); returns how many."""
    now, n = time.time(), 0
    for name in os.listdir(directory_):
        if name.startswith(PREFIX) and name.endswith(".tmp"):
            p = os.path.join(directory_, name)
            with contextlib.suppress(FileNotFoundError):
                if now - os.lstat(p).st_mtime > age_s:
                    remove(p)
                    n += 1
    return n


def secret(root: str) -> bytes:
    """``root``'s key (``kiln_secret.key``), made on first use: 32 random bytes in a file of mode 0600
    put in place by a hard link (or an exclusive create), so that concurrent first users agree."""
    with _LOCK:
        key = _KEYS.get(root)
    if key is not None:
        return key
    path = os.path.join(root, KEY_FILE)
    if not os.path.lexists(path):
        _make_key(root, path)
    for _ in range(100):   # a process making it with an exclusive create may not have written it yet
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            key = f.read()
        if hasattr(os, "getuid") and st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise DirRefused(f"{path} is not this user's private key file (uid {st.st_uid}, mode "
                             f"{oct(st.st_mode & 0o777)}); kiln loads nothing from {root}. Fix: delete it "
                             f"(kiln makes a new one) or use another directory")
        if len(key) == 32:
            break
        time.sleep(0.01)
    else:
        raise DirRefused(f"{path} does not hold a key of 32 bytes; delete it (kiln makes a new one)")
    with _LOCK:
        _KEYS[root] = key
    return key


def _make_key(root: str, path: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=PREFIX, suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)   # atomic, and fails when the name exists: the first process wins
        except FileExistsError:
            pass
        except OSError:   # a file system without hard links
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except FileExistsError:
                return
            with os.fdopen(fd, "wb") as f:
                f.write(read(tmp))
    finally:
        remove(tmp)


def sign(root: str, data: bytes) -> str:
    """The HMAC-SHA256 of ``data`` under ``root``'s key, in hex."""
    return hmac.new(secret(root), data, hashlib.sha256).hexdigest()


def verify(root: str, data: bytes, mac) -> bool:
    """Whether ``mac`` (hex, str or bytes) is ``data``'s under ``root``'s key."""
    mac = mac.decode("ascii", "replace") if isinstance(mac, bytes) else str(mac)
    return hmac.compare_digest(sign(root, data), mac.strip())
