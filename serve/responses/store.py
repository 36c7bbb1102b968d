"""The Responses store: each stored response (its JSON object, its own input items and the
conversation it continued) in one sqlite3 database, so ``GET /v1/responses/{id}`` and
``previous_response_id`` survive restarts.

Every write is one transaction in WAL mode: a crash mid-write loses at most the response being
written, never the others; a SIGKILL loses nothing committed.  Writes go through one writer
thread (``put_async``: the event loop is not blocked, and a response is stored before its
answer is sent); reads share the one connection under a lock.  A file that is not a readable
database is moved aside (one warning) and a new store started, as the cache folder's other
damaged entries are.
Bounded by age (rows older than ``max_age_s`` go) and by size (the oldest rows go until the
stored bytes fit ``max_bytes``), checked on every write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from jaxllm.config import ServingConfig, default_cache_dir

log = logging.getLogger("jaxllm.serve")

DEFAULT_FILE = "responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    nbytes INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


def store_path(setting: str) -> str | None:
    """``--responses-store``: ``auto`` (the cache folder's file), ``none`` (no store) or a path."""
    if setting == "none":
        return None
    if setting == "auto":
        return os.path.join(default_cache_dir(), DEFAULT_FILE)
    return setting


def open_store(config: ServingConfig) -> ResponseStore | None:
    """The store ``config`` asks for (``--responses-store`` and its bounds), or None for ``none``."""
    path = store_path(config.responses_store)
    if path is None:
        return None
    return ResponseStore(path, config.responses_store_max_bytes, config.responses_store_max_age_s)


def _open(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a process crash loses nothing committed
        db.executescript(_SCHEMA)
        db.execute("SELECT COUNT(*) FROM responses").fetchone()
    except sqlite3.DatabaseError:
        db.close()
        raise
    return db


class ResponseStore:
    def __init__(self, path: str, max_bytes: int, max_age_s: float):
        if max_bytes < 1 or max_age_s <= 0:
            raise ValueError(f"responses store bounds must be positive, got max_bytes={max_bytes}, "
                             f"max_age_s={max_age_s}")
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            try:
                self._db = _open(path)
            except sqlite3.DatabaseError as e:
                aside = f"{path}.damaged-{int(time.time())}"
                log.warning("responses store %s is not a readable database (%s); moved to %s, starting a new one",
                            path, e, aside)
                os.replace(path, aside)
                for suffix in ("-wal", "-shm"):
                    if os.path.exists(path + suffix):
                        os.remove(path + suffix)
                self._db = _open(path)
        except (OSError, sqlite3.Error) as e:
            raise ValueError(f"--responses-store {path}: cannot open the database ({e})") from None
        self.path = path
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="responses-store")

    async def put_async(self, response: dict, input_items: list[dict], conversation: list[dict]) -> None:
        """``put`` on the writer thread."""
        await asyncio.get_running_loop().run_in_executor(self._writer, self.put, response, input_items, conversation)

    def put(self, response: dict, input_items: list[dict], conversation: list[dict]) -> None:
        """Inserts or replaces one response, then evicts what the bounds no longer allow; one transaction."""
        body = json.dumps(response, ensure_ascii=False, separators=(",", ":"))
        items = json.dumps(input_items, ensure_ascii=False, separators=(",", ":"))
        conv = json.dumps(conversation, ensure_ascii=False, separators=(",", ":"))
        nbytes = len(body) + len(items) + len(conv)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                                 (response["id"], time.time(), nbytes, body, items, conv))
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _evict(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.max_age_s,))
        total, = self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM responses").fetchone()
        if total <= self.max_bytes:
            return
        # Oldest first, until what is left fits.
        drop, excess = [], total - self.max_bytes
        for rid, n in self._db.execute("SELECT id, nbytes FROM responses ORDER BY created_at"):
            if excess <= 0:
                break
            drop.append((rid,))
            excess -= n
        self._db.executemany("DELETE FROM responses WHERE id = ?", drop)

    def _row(self, rid: str, column: str):
        with self._lock:
            row = self._db.execute(f"SELECT {column} FROM responses WHERE id = ? AND created_at >= ?",
                                   (rid, time.time() - self.max_age_s)).fetchone()
        return None if row is None else json.loads(row[0])

    def get(self, rid: str) -> dict | None:
        return self._row(rid, "response")

    def input_items(self, rid: str) -> list[dict] | None:
        return self._row(rid, "input_items")

    def conversation(self, rid: str) -> list[dict] | None:
        """The items the response answered (earlier turns included) followed by its output."""
        conv = self._row(rid, "conversation")
        resp = self.get(rid)
        return None if conv is None or resp is None else conv + resp.get("output", [])

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def total_bytes(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM responses").fetchone()[0]

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        with self._lock:
            self._db.close()
