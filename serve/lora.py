"""LoRA adapters on the server, vLLM's surface: the ``--enable-lora`` / ``--lora-modules`` /
``--max-loras`` / ``--max-lora-rank`` / ``--max-cpu-loras`` / ``--lora-dtype`` flags, the adapters a request may
select by ``"model": NAME``, and the runtime ``POST /v1/load_lora_adapter`` /
``POST /v1/unload_lora_adapter`` routes (only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
or ``JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; otherwise those routes are 404, as in vLLM).

The engine does the work (jaxllm/lora/): an adapter is read and checked by the engine's
adapter store, put in a device slot by the scheduler, and never compiles anything.  Under
``-dp N`` each replica has its own store: a load reads the adapter into every one of them (a
replica reading it later, from a folder changed or gone since, would fail its step), and one
that fails is dropped from those that succeeded before the 400, so a load reaches every
replica or none.  The name is resolved here, before routing, so an unload reaches every
replica at once (the 404 does not depend on where a request would go).  Unloading
removes the name from the server (new requests get a 404); a request already running keeps
its adapter, and its slot is reclaimed by the scheduler's LRU.  Every adapter gets a new
integer id, so a name loaded again from another folder never reuses the old weights.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
from dataclasses import dataclass
from http import HTTPStatus

from jaxllm.lora.config import LORA_DTYPES, LORA_RANKS, LoRAConfig
from jaxllm.lora.request import LoRARequest
from serve.protocol import APIError, bad_request

RUNTIME_ENV_VARS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters (PEFT folders)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: a request selects one by its name in \"model\"")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters served from the start: NAME=PATH or the JSON form '
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters resident in device slots at once (default 1); more wait for a slot")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help=f"the largest adapter rank (default 16; one of {', '.join(map(str, LORA_RANKS))})")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (default: --max-loras)")
    g.add_argument("--lora-dtype", default="auto",
                   help=f"the adapters' dtype in their device slots, one of {', '.join(LORA_DTYPES)} (default "
                        "auto: the model's dtype; bfloat16 halves their reads, the arithmetic stays float32)")


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """``--lora-modules`` entries; ValueError naming the flag and the entry."""
    out: list[LoRAModule] = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not {"name", "path"} <= set(obj) or set(obj) - {
                    "name", "path", "base_model_name"}:
                raise ValueError(f"--lora-modules {value!r}: the JSON form is "
                                 '{"name": ..., "path": ..., "base_model_name": ...} (name and path required)')
            name, path, base = obj["name"], obj["path"], obj.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            base = None
            if not sep:
                raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH or a JSON object")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path \
                or (base is not None and not isinstance(base, str)):
            raise ValueError(f"--lora-modules {value!r}: the name and the path must be non-empty strings")
        if any(m.name == name for m in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoRAModule(name, path, base))
    return tuple(out)


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig:
    """The engine's LoRA settings from the flags; ValueError naming the flag."""
    modules = parse_lora_modules(args.lora_modules)
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return LoRAConfig(enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras, lora_dtype=args.lora_dtype)


def runtime_updates_allowed(environ=os.environ) -> bool:
    """vLLM's switch (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, "true" or "1" in any case) or jaxllm's."""
    return any(environ.get(k, "").strip().lower() in ("1", "true") for k in RUNTIME_ENV_VARS)


class LoRARegistry:
    """The adapters this server answers to: name -> LoRARequest (each with a fresh integer id)."""

    def __init__(self, stores, base_model_name: str):
        self._stores = tuple(stores)     # each replica's AdapterStore; empty: the engine runs without LoRA
        self.base_model_name = base_model_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return bool(self._stores)

    def names(self) -> list[str]:
        return list(self._by_name)

    def items(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Reads and checks the adapter into every replica's store (ValueError naming
        ``lora_path`` when the model cannot take it; then no replica keeps it)."""
        if not self._stores:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        for i, store in enumerate(self._stores):
            try:
                store.get(lora)
            except Exception:
                for done in self._stores[:i]:   # all or nothing
                    done.drop(lora.lora_int_id)
                raise
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)


def load_static(registry: LoRARegistry, modules: tuple[LoRAModule, ...]) -> None:
    """The ``--lora-modules`` adapters, read at start-up: a bad one fails the start, by name."""
    for m in modules:
        try:
            registry.add(m.name, m.path, m.base_model_name)
        except ValueError as e:
            raise ValueError(f"--lora-modules {m.name}={m.path}: {e}") from None


def _field(body, key: str) -> str | None:
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


def add_runtime_routes(app, registry: LoRARegistry, parse_json, taken_names) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (answers and codes of
    vLLM's ``serving_models.py``).  ``taken_names``: the base model's names, which an adapter
    may not take."""
    from quart import Response

    def ok(message: str):
        return Response(message, status=200, mimetype="text/plain")

    @app.post("/v1/load_lora_adapter")
    async def _load():
        body = await parse_json()
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name is None or path is None:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if name is None
                              else "lora_path")
        if registry.get(name) is not None or name in taken_names:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            await asyncio.to_thread(registry.add, name, path)
        except ValueError as e:
            raise bad_request(f"cannot load the lora adapter '{name}': {e}", "lora_path") from None
        return ok(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def _unload():
        body = await parse_json()
        name = _field(body, "lora_name")
        if name is None:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        if registry.remove(name) is None:
            raise APIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return ok(f"Success: LoRA adapter '{name}' removed successfully.")
