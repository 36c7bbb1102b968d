"""Adapters read into host memory, least recently used dropped past ``max_cpu_loras``.

The input processor reads an adapter here when a request names it (so a bad adapter is
refused before anything is queued); the runner takes it from here when the scheduler puts
it in a device slot, reading the folder again if it was dropped meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from jaxllm.lora.peft import LoRAWeights, read_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.targets import Target


class AdapterStore:
    def __init__(self, targets: dict[str, Target], num_layers: int, max_rank: int, capacity: int):
        self.targets = targets
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.capacity = capacity
        self._cache: OrderedDict[LoRARequest, LoRAWeights] = OrderedDict()
        self._lock = threading.Lock()   # the server's request thread and the engine's step thread

    def get(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's weights; raises ValueError naming ``lora_path`` for one this model cannot take."""
        with self._lock:
            hit = self._cache.get(lora)
            if hit is not None:
                self._cache.move_to_end(lora)
                return hit
        w = read_adapter(lora.lora_path, self.targets, self.num_layers, self.max_rank)
        with self._lock:
            self._cache[lora] = w
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return w

    def drop(self, lora_int_id: int) -> bool:
        """Forgets adapter ``lora_int_id``'s weights; whether it was held."""
        with self._lock:
            held = [k for k in self._cache if k.lora_int_id == lora_int_id]
            for k in held:
                del self._cache[k]
        return bool(held)
