"""The compile cache's directory: entries written atomically, checked before they are read.

An entry is one file, ``<key>.kiln``: a header line (a magic word, the sha256 of the payload and its
length) and the payload (pickled bytes). ``read`` returns the payload only when the file is whole and
its hash matches; a truncated or garbled file is deleted and reported as a miss, so the caller compiles
again and writes a good entry. Writers write a private temporary file and rename it over the entry:
several processes filling one cache (ranks of one job) never see a partial file, and the last
rename wins with an equal entry. The directory is made with mode 0700 and refused when other users
may write to it. ``evict`` keeps the directory under a size limit, dropping the entries read
longest ago first (a hit touches its file's modification time).
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
import time
from kiln.options import UserError

MAGIC = b"kiln-cache-1"
SUFFIX = ".kiln"


class CacheDirError(RuntimeError, UserError):
    """The cache directory cannot be used safely (made by another user, writable by others)."""


def default_dir() -> str:
    """``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln`` (``cache_dir`` and ``KILN_CACHE_DIR`` override)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


def directory(path=None) -> str:
    """The cache directory, made with mode 0700 when missing; raises ``CacheDirError`` when it is not
    the user's own or others may write to it (a shared directory could hand this process code)."""
    path = os.path.abspath(os.path.expanduser(str(path or default_dir())))
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheDirError(f"compile cache {path} belongs to another user (uid {st.st_uid}); set cache_dir "
                            f"(KILN_CACHE_DIR) to a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(f"compile cache {path} is writable by other users (mode {oct(st.st_mode & 0o777)}); "
                            f"chmod 700 it or set cache_dir (KILN_CACHE_DIR) elsewhere")
    return path


def entry_path(root: str, key: str) -> str:
    return os.path.join(root, key + SUFFIX)


def write(root: str, key: str, payload: bytes) -> str:
    """Write entry ``key`` atomically; returns its path."""
    digest = hashlib.sha256(payload).hexdigest()
    header = MAGIC + b" " + digest.encode() + b" " + str(len(payload)).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        path = entry_path(root, key)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    return path


def read(root: str, key: str):
    """(payload, None) for a whole entry; (None, reason) for a missing one (reason "missing") or a
    damaged one (deleted here, reason says what was wrong)."""
    path = entry_path(root, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e})"
    head, nl, payload = data.partition(b"\n")
    parts = head.split(b" ")
    why = None
    if not nl or len(parts) != 3 or parts[0] != MAGIC:
        why = "not a kiln cache entry (bad header)"
    elif not parts[2].isdigit() or int(parts[2]) != len(payload):
        why = f"truncated ({len(payload)} of {parts[2].decode(errors='replace')} bytes)"
    elif hashlib.sha256(payload).hexdigest().encode() != parts[1]:
        why = "content hash mismatch"
    if why is not None:
        _remove(path)
        return None, why
    touch(path)
    return payload, None


def touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def entries(root: str) -> list:
    """[(path, size, mtime)] of the entries, oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(SUFFIX):
            continue
        try:
            st = os.stat(os.path.join(root, name))
        except FileNotFoundError:
            continue
        out.append((os.path.join(root, name), st.st_size, st.st_mtime))
    out.sort(key=lambda e: e[2])
    return out


_EVICT_LOCK = threading.Lock()


def evict(root: str, limit_bytes: int) -> int:
    """Delete the oldest entries until the rest fit in ``limit_bytes``; also stale temporary files (an
    hour old: a writer that died). Returns how many entries went."""
    with _EVICT_LOCK:
        now = time.time()
        for name in os.listdir(root):
            if name.endswith(".tmp"):
                p = os.path.join(root, name)
                try:
                    if now - os.stat(p).st_mtime > 3600:
                        _remove(p)
                except FileNotFoundError:
                    pass
        found = entries(root)
        total, gone = sum(size for _, size, _ in found), 0
        for path, size, _ in found:
            if total <= limit_bytes:
                break
            _remove(path)
            total -= size
            gone += 1
        return gone


def info(root: str) -> dict:
    found = entries(root)
    return {"dir": root, "entries": len(found), "bytes": sum(s for _, s, _ in found),
            "oldest": found[0][2] if found else None, "newest": found[-1][2] if found else None}


def clear(root: str) -> int:
    """Delete every entry (and temporary file); returns how many entries went."""
    n = 0
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if name.endswith(SUFFIX) or name.endswith(".tmp"):
            n += name.endswith(SUFFIX)
            _remove(os.path.join(root, name))
    return n


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
