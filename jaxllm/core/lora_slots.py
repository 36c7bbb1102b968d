"""Which LoRA adapter sits in which device slot: the scheduler's table, pure Python.

``max_loras`` slots; a slot holding an adapter some running request uses is pinned.  A
request's adapter gets its resident slot, else a free one, else the least recently used
unpinned one (its adapter evicted); when every slot is pinned by other adapters the request
waits.  A newly assigned slot is reported once, to be written before the step runs.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxllm.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # adapter id -> slot, least recently used first
        self._adapter: dict[int, LoRARequest] = {}              # slot -> adapter
        self._pins: dict[int, int] = {}                         # slot -> running requests using it

    def _victim(self) -> int | None:
        """A slot to (re)use: a free one, else the least recently used unpinned one."""
        free = [s for s in range(self.max_loras) if s not in self._adapter]
        if free:
            return free[0]
        for s in self._slot_of.values():
            if not self._pins.get(s):
                return s
        return None

    def can_acquire(self, lora: LoRARequest) -> bool:
        return lora.lora_int_id in self._slot_of or self._victim() is not None

    def acquire(self, lora: LoRARequest) -> tuple[int, bool]:
        """(slot, whether the slot must be written) for a request of ``lora`` being admitted;
        call only after :meth:`can_acquire`."""
        aid = lora.lora_int_id
        slot = self._slot_of.get(aid)
        load = slot is None or self._adapter[slot] != lora
        if slot is None:
            slot = self._victim()
            if slot is None:
                raise RuntimeError(f"no LoRA slot free for {lora.lora_name!r}")
            old = self._adapter.get(slot)
            if old is not None:
                del self._slot_of[old.lora_int_id]
        self._slot_of[aid] = slot
        self._slot_of.move_to_end(aid)
        self._adapter[slot] = lora
        self._pins[slot] = self._pins.get(slot, 0) + 1
        return slot, load

    def release(self, slot: int) -> None:
        """A request using ``slot`` stopped running (finished, aborted or preempted)."""
        if slot >= 0:
            self._pins[slot] -= 1

    def forget(self, lora_int_id: int) -> int | None:
        """Drops an unloaded adapter from its slot (if resident and unpinned); its slot or None."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None or self._pins.get(slot):
            return None
        del self._slot_of[lora_int_id]
        del self._adapter[slot]
        return slot

    def resident(self) -> dict[int, LoRARequest]:
        """Slot -> adapter, for the metrics' running adapters."""
        return dict(self._adapter)
