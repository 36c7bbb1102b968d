"""``LoRAConfig``: the engine's LoRA settings (``enable_lora``, ``--max-loras``,
``--max-lora-rank``, ``--max-cpu-loras``, ``--lora-dtype``), vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's accepted ranks; the slot arrays are padded to the chosen one.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# vLLM's ``--lora-dtype`` choices, and float32 (the default's dtype for a float32 model).
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


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
    lora_dtype: str = "auto"
    """The device slots' dtype (vLLM's ``--lora-dtype``): "auto" (the model's dtype),
    "float16", "bfloat16" or "float32".  The shrink and expand accumulate in float32 whatever
    it is; a 16-bit dtype halves the adapter bytes a step reads (lora/slots.py)."""

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

        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"--lora-dtype {self.lora_dtype!r} is not one of {', '.join(LORA_DTYPES)}")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
