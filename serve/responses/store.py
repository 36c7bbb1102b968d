"""The Responses store: each stored response (its JSON object, its own input items and the
conversation it continued) in one sqlite3 database, so ``GET /v1/responses/{id}`` and
``previous_response_id`` survive restarts.

Every write is one transaction in WAL mode: a crash mid-write loses at most the response being
written, never the others.  One connection, shared by the server's threads under a lock.
Bounded by age (rows older than ``max_age_s`` go) and by size (the oldest rows go until the
stored bytes fit ``max_bytes``), checked on every write.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time

from jaxllm.config import default_cache_dir

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


class ResponseStore:
    def __init__(self, path: str, max_bytes: int, max_age_s: float):
        if max_bytes < 1 or max_age_s <= 0:
            raise ValueError(f"responses store bounds must be positive, got max_bytes={max_bytes}, "
                             f"max_age_s={max_age_s}")
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise ValueError(f"--responses-store {path}: cannot open the database ({e})") from None
        self.path = path
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()

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
        with self._lock:
            self._db.close()
