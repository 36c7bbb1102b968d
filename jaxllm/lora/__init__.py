"""Multi-LoRA: PEFT adapters applied per token inside the compiled step.

``request.py`` is the per-request selector (vLLM's ``LoRARequest``), ``config.py`` the engine
settings, ``targets.py`` which projections of a family an adapter may change, ``peft.py``
reads an adapter folder as PEFT saves it, ``slots.py`` holds the device slot arrays and
writes adapters into them, ``apply.py`` is the per-token delta the layers add.
"""
