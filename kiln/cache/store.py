"""The compile cache's directory: entries written atomically (a private temporary file renamed over the entry)
and authenticated before they are read: ``kiln_<key>.kiln`` is a header (magic, the payload's HMAC-SHA256
under the directory's key, its length) and the payload; one that fails (it could hand this process code)
is deleted, a miss. ``evict`` (oldest read first) and ``clear`` delete only files kiln named.
"""
import contextlib
import os
import threading

from kiln.runtime import private

MAGIC = b"kiln-cache-2"
SUFFIX = ".kiln"
HOW = "cache_dir (KILN_CACHE_DIR)"
CacheDirError = private.DirRefused   # the cache directory cannot be used safely


def default_dir() -> str:
    """``$XDG_CACHE_HOME/kiln/graphs``, else ``~/.cache/kiln/graphs``."""
    return private.user_dir("graphs")


def directory(path=None) -> str:
    """The cache directory (made with mode 0700) and its key; ``CacheDirError`` when refused or not makeable."""
    path = path or default_dir()
    try:
        root = private.directory(path, HOW)
        private.secret(root)
    except CacheDirError:
        raise
    except OSError as e:
        raise CacheDirError(f"{os.path.abspath(os.path.expanduser(str(path)))} cannot be used as a directory "
                            f"({e.strerror or e}{': ' + e.filename if e.filename and e.filename != path else ''}); "
                            f"kiln writes and loads nothing there. Fix: set {HOW} to a directory of your own") from None
    return root


def entry_path(root: str, key: str) -> str:
    return os.path.join(root, private.PREFIX + key + SUFFIX)


def write(root: str, key: str, payload: bytes) -> str:
    """Write entry ``key`` atomically, signed; returns its path."""
    header = MAGIC + b" " + private.sign(root, payload).encode() + b" " + str(len(payload)).encode() + b"\n"
    return private.write(root, os.path.basename(entry_path(root, key)), header + payload, sync=True)


def read(root: str, key: str):
    """(payload, None) for a whole entry, else (None, "missing" or what was wrong: the entry is deleted)."""
    path = entry_path(root, key)
    try:
        data = private.read(path)
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
    elif not private.verify(root, payload, parts[1]):
        why = "its MAC does not verify (damaged, or not written by kiln for this user)"
    if why is not None:
        private.remove(path)
        return None, why
    with contextlib.suppress(OSError):
        os.utime(path)   # read now: evicted last
    return payload, None


def entries(root: str) -> list:
    """[(path, size, mtime)] of the entries, oldest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if name.startswith(private.PREFIX) and name.endswith(SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(os.path.join(root, name))
                out.append((os.path.join(root, name), st.st_size, st.st_mtime))
    return sorted(out, key=lambda e: e[2])


_EVICT_LOCK = threading.Lock()


def evict(root: str, limit_bytes: int) -> int:
    """Delete the oldest entries until the rest fit in ``limit_bytes``, and stale temporary files."""
    with _EVICT_LOCK:
        private.remove_stale(root)
        found = entries(root)
        total, gone = sum(size for _, size, _ in found), 0
        for path, size, _ in found:
            if total <= limit_bytes:
                break
            private.remove(path)
            total -= size
            gone += 1
        return gone


def info(root: str) -> dict:
    found = entries(root)
    return {"dir": root, "entries": len(found), "bytes": sum(s for _, s, _ in found),
            "oldest": found[0][2] if found else None, "newest": found[-1][2] if found else None}


def clear(root: str) -> int:
    """Delete every entry and kiln's temporary files (no other file); returns how many entries went."""
    found = entries(root)
    for path, _, _ in found:
        private.remove(path)
    private.remove_stale(root, 0.0)
    return len(found)
