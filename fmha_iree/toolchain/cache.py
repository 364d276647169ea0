"""The on-disk module cache: one entry per key (spec, flags, toolchain), checked before use.

Where: ``$FMHA_IREE_CACHE``, else ``$XDG_CACHE_HOME/fmha_iree``, else ``~/.cache/fmha_iree``; below
it one folder per source fingerprint (``compile.source_fingerprint``). An entry is ``KEY.vmfb`` and
``KEY.json`` (how it was built, the spec, the vmfb's sha256), each written atomically (temp file +
rename, ``0600``) under a file lock, in folders created ``0700``, so concurrent processes compile a
module once.

A load checks the sidecar's key, spec and digest before the bytes reach the runtime (a flipped,
truncated or foreign ``.vmfb`` crashed or misled IREE's runtime); an entry that fails is rebuilt
and replaced, with a warning. A cache folder owned by another user or writable by others is not
used (``FMHA_IREE_CACHE_TRUST=1`` opts in); one that cannot be written still serves the entries it
holds, and modules it lacks stay in this process's memory, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import warnings
from pathlib import Path

__all__ = ["DiskCache", "atomic_write", "cache_root"]


def cache_root() -> Path:
    """The cache's top folder (see the module docstring)."""
    if os.environ.get("FMHA_IREE_CACHE"):
        return Path(os.environ["FMHA_IREE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fmha_iree"


def atomic_write(path: Path, data: bytes, mode: int = 0o666):
    """Write ``data`` to ``path`` through a temp file and a rename (created with ``mode``, less the
    umask)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class DiskCache:
    """Entries under ``folder``; ``problem()`` says why it cannot be used (None: it can)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def problem(self) -> str | None:
        """Why entries cannot be read and written here (None: they can)."""
        why = self.untrusted()
        if why is None and not os.access(self.folder, os.W_OK | os.X_OK):
            why = f"{self.folder} is not writable"
        return why

    def untrusted(self) -> str | None:
        """Why the folder is not one to load native code from (None: it is): it cannot be
        created, or it or its parent is another user's or writable by every user."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot create {self.folder}: {e}"
        if os.environ.get("FMHA_IREE_CACHE_TRUST") != "1":
            for d in (self.folder, self.folder.parent):
                st = d.stat()
                if hasattr(os, "getuid") and st.st_uid != os.getuid():
                    return f"{d} is owned by another user (set FMHA_IREE_CACHE_TRUST=1 to use it anyway)"
                if st.st_mode & stat.S_IWOTH:
                    return f"{d} is writable by every user (set FMHA_IREE_CACHE_TRUST=1 to use it anyway)"
        return None

    def readable(self) -> bool:
        """Whether a folder that cannot be written is still one to read entries from: trusted
        (ours, not writable by others) and readable. Entries are written atomically, so reading
        without the lock sees whole files."""
        return self.untrusted() is None and os.access(self.folder, os.R_OK | os.X_OK)

    def lock(self, key: str):
        from filelock import FileLock

        return FileLock(str(self.folder / f"{key}.lock"))

    def load(self, key: str, spec: dict) -> bytes | None:
        """The entry's module if it passes its checks; None if there is none or it fails (warned)."""
        vmfb_path, rec_path = self.folder / f"{key}.vmfb", self.folder / f"{key}.json"
        spec = json.loads(json.dumps(spec))  # as the record holds it (tuples as lists)
        if not vmfb_path.exists():
            return None
        try:
            vmfb = vmfb_path.read_bytes()
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError) as e:
            why = f"unreadable ({e})"
        else:
            why = None if isinstance(rec, dict) else "its record is not an object"
            if why is None and rec.get("key") != key:
                why = f"its record is for {rec.get('key')!r}"
            elif why is None and rec.get("spec") != spec:
                why = "its record names another spec"
            elif why is None and rec.get("sha256") != hashlib.sha256(vmfb).hexdigest():
                why = "its bytes do not match the digest in its record"
            if why is None:
                return vmfb
        warnings.warn(f"fmha_iree: cache entry {vmfb_path} failed its check ({why}); compiling it again",
                      RuntimeWarning, stacklevel=3)
        return None

    def store(self, key: str, vmfb: bytes, record: dict):
        """Write the module, then its record (the record last: an entry without one is not valid)."""
        rec = {**record, "key": key, "sha256": hashlib.sha256(vmfb).hexdigest()}
        atomic_write(self.folder / f"{key}.vmfb", vmfb, 0o600)
        atomic_write(self.folder / f"{key}.json", json.dumps(rec, indent=2).encode(), 0o600)
