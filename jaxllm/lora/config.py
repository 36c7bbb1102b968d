"""``LoRAConfig``: the engine's LoRA settings (``enable_lora``, ``--max-loras``,
``--max-lora-rank``, ``--max-cpu-loras``), vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's accepted ranks; the slot arrays are padded to the chosen one.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 1
    """Adapters resident in device slots at once (one step mixes at most this many)."""
    max_lora_rank: int = 16
    """Every slot's rank: smaller adapters are zero-padded to it."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (None: ``max_loras``); the least recently used
    beyond it is dropped and read again from its folder when asked for."""

    def __post_init__(self):
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"--max-lora-rank {self.max_lora_rank} is not one of {', '.join(map(str, LORA_RANKS))}")
        if self.max_cpu_loras is not None:
            v = self.max_cpu_loras
            if isinstance(v, bool) or not isinstance(v, int) or v < self.max_loras:
                raise ValueError(f"--max-cpu-loras ({v!r}) must be an integer >= --max-loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
