"""Cache entries are disposable: written atomically, checked before they are trusted.

Every cache under the cache folder (converted tokenizers, native kernels, saved programs,
JAX's compilation cache) treats an entry that is damaged, truncated or written by something
else as a miss: the caller rebuilds it and :func:`report_rebuild` says so in one log line
naming the entry.  Writes go to a temporary file in the same folder and are renamed into
place, so a crash never leaves a half-written entry under the final name.

A *seal* is a digest of an entry's bytes, written after the entry itself: a file with a
missing or wrong seal (a build killed between the two, garbage written over it, a truncated
copy) is not trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger("jaxllm.cache")

SEAL_SUFFIX = ".sha256"
FOLDER_SEAL = "jaxllm-digests.json"


def atomic_write(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path)[-16:])
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def seal(path: str) -> None:
    """Records the size and digest of the finished file ``path`` beside it (``path.sha256``)."""
    atomic_write(path + SEAL_SUFFIX, f"{os.path.getsize(path)} {file_digest(path)}\n".encode())


def seal_problem(path: str) -> str | None:
    """Why the file ``path`` cannot be trusted (no seal, another size, another digest), or None."""
    try:
        with open(path + SEAL_SUFFIX) as f:
            size, digest = f.read().split()
    except (OSError, ValueError, UnicodeDecodeError):
        return "no valid seal beside it"
    if os.path.getsize(path) != int(size):
        return f"{os.path.getsize(path)} bytes, {size} when written"
    if file_digest(path) != digest:
        return "its contents changed since it was written"
    return None


def seal_folder(folder: str) -> None:
    """Records the digest of every file in ``folder`` (before the folder is renamed into place)."""
    digests = {name: file_digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
               if name != FOLDER_SEAL and os.path.isfile(os.path.join(folder, name))}
    atomic_write(os.path.join(folder, FOLDER_SEAL), json.dumps(digests, indent=0).encode())


def folder_problem(folder: str) -> str | None:
    """Why the folder sealed by :func:`seal_folder` cannot be trusted, or None."""
    try:
        with open(os.path.join(folder, FOLDER_SEAL)) as f:
            digests = json.load(f)
        if not isinstance(digests, dict) or not digests:
            raise ValueError
    except (OSError, ValueError, UnicodeDecodeError):
        return f"no valid {FOLDER_SEAL}"
    for name, digest in digests.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if file_digest(path) != digest:
            return f"{name} changed since it was written"
    return None


def report_rebuild(path: str, reason: str, action: str = "rebuilding it") -> None:
    """The one log line for a cache entry that is not trusted."""
    log.warning("damaged cache entry %s (%s); %s", path, reason, action)


def discard(path: str, reason: str, action: str) -> None:
    """Reports the untrusted entry ``path`` (a file or a folder) and removes it; one already
    gone (another process discarded it first) is no error."""
    report_rebuild(path, reason, action)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
