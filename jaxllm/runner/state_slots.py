"""Per-sequence state slots by request id: which slot of a recurrent layer's state arrays
(models/qwen3_next/'s GDN conv and delta-rule states) each running request owns.

A request gets a slot when the runner first sees it (again after preemption: a fresh one)
and gives it back when it ends or is preempted.  There are exactly as many slots as the KV
budget seats (``max_num_seqs`` clamped to them, engine/resolve.py), so the scheduler never
runs more requests than there are slots.  Padding sequences take :attr:`padding`, an index
past the last slot: the step reads zeros for it and its writes are dropped.  Zeroing a
request's state is the step's job: a sequence whose first token this step is at position 0
starts from zeros (its first step, or its recompute after preemption).
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"StateSlots needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}

    @property
    def padding(self) -> int:
        """The slot of padding sequences: out of range (reads zeros, writes nothing)."""
        return self.num_slots

    def add(self, req_id: str) -> int:
        """Gives ``req_id`` a slot (keeps the one it has) and returns it."""
        if req_id in self._slots:
            return self._slots[req_id]
        if not self._free:
            raise RuntimeError(f"no state slot free for request {req_id!r}: {self.num_slots} slots, all in use "
                               "(the scheduler runs at most max_num_seqs requests, clamped to the slots)")
        slot = self._slots[req_id] = self._free.pop()
        return slot

    def remove(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, req_id: str) -> int:
        return self._slots[req_id]

    def __len__(self) -> int:
        return len(self._slots)
