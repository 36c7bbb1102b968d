"""Checkpoint loading: HF folders (config.json + *.safetensors) and GGUF files.

Whatever the format, the result is a ``LoadedModel``: an ``ArchConfig`` and host (numpy)
weights under our internal names.  The names, shapes and presence of the parameters come
from the model's parameter table (``models/params.py``), read for both formats by one
:class:`NameMap`.  Every tensor in the files must be consumed and every parameter filled
with the right shape, or loading fails with a ``ModelLoadError`` that names the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from jaxllm.errors import ModelLoadError
from jaxllm.formats.int_weights import ONLINE
from jaxllm.models import gguf_tensors
from jaxllm.models.builtin import BUILTIN_MODEL_NAME, builtin_gguf_path
from jaxllm.models.config import ArchConfig
from jaxllm.models.gguf_file import read_gguf
from jaxllm.models.llama.variants import PHI3_FACTORS
from jaxllm.models.params import GLOBAL, Chunk, Param, Pattern, Stored, interleave
from jaxllm.models.registry import GGUF_ARCHITECTURES, get_family, get_model_module, read_config, read_gguf_config
from jaxllm.layers.rotary import inv_frequencies
from jaxllm.quant import gguf_blocks, hf_formats
from jaxllm.quant.ops import is_quantized, map_fields, summary


@dataclass
class TokenizerSource:
    """Where the tokenizer lives: an HF folder, or a GGUF file whose metadata holds it."""

    path: str
    gguf_file: str | None = None


@dataclass
class LoadedModel:
    name: str
    arch: ArchConfig
    layers: list[dict[str, np.ndarray]]
    globals: dict[str, np.ndarray]
    rope_inv_freq: np.ndarray
    tokenizer: TokenizerSource | None
    generation_config: dict = field(default_factory=dict)
    rope_tables: dict[str, np.ndarray] = field(default_factory=dict)
    """Further RoPE frequency tables by parameter name (Gemma 3's sliding layers' base)."""
    vision: object | None = None
    """A vision-language checkpoint's image side (its family's ``vision.split_checkpoint``), or None."""

    def tensors(self) -> list:
        return [*self.globals.values(), *(a for lp in self.layers for a in lp.values())]

    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.tensors())

    def formats(self) -> str:
        """How many weights of each storage format (``quant/ops.summary``), for the load log."""
        return summary(self.tensors())


# ------------------------------------------------------------------ safetensors

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,   # FP8 checkpoints (compressed-tensors float-quantized, fp8)
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-maps every tensor of a .safetensors file (bf16 included, via ml_dtypes)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(dtype).reshape(info["shape"])
    return out


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def load_hf_folder(path: str, quantization: str | None = None) -> LoadedModel:
    """An HF folder's model.  A quantized checkpoint (config.json's ``quantization_config``:
    compressed-tensors, gptq, fp8) keeps its linear layers quantized
    (``quant/hf_formats.py``); ``quantization`` (``--quantization``): None takes what the
    checkpoint is, a checkpoint method must match it, and ``int8`` / ``fp8`` on a float
    checkpoint quantize its linear layers at load (``formats/int_weights.ONLINE``)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected an HF model folder or a .gguf file)")
    raw = _read_json(cfg_path)
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{cfg_path}: names no architecture")
    get_model_module(archs[0])  # refuses unknown architectures by name before anything else
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a bad config
        raise ModelLoadError(f"{cfg_path}: transformers cannot read it ({e})") from None
    arch = read_config(hf, cfg_path)
    method = hf_formats.checkpoint_method(raw.get("quantization_config"), cfg_path)
    online = _check_quantization_flag(quantization, method, path)

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for fname in files:
        for name, arr in read_safetensors(os.path.join(path, fname)).items():
            tensors[name] = (arr, fname)
    if method is not None:
        tensors = hf_formats.build(method, raw["quantization_config"], tensors, where=path)

    ignored = get_family(arch.architecture).ignored_tensors
    vision_family = get_family(arch.architecture).vision
    vision = None
    if vision_family is not None:
        # the image encoder's tensors leave here; the rest are the text model's, renamed
        tensors, vision = vision_family.split_checkpoint(hf, tensors, path)
    mtp = int(getattr(hf, "num_mtp_layers", None) or getattr(hf, "num_nextn_predict_layers", None) or 0)

    def skip(name: str) -> bool:
        # Non-persistent rotary buffers some old checkpoints saved, and a tied head saved anyway;
        # GLM-4-MoE's multi-token-prediction layers after the last decoder layer (transformers
        # skips them too: no speculative decoding here).
        if mtp and name.startswith("model.layers."):
            idx = name.split(".")[2]
            if idx.isdigit() and arch.num_layers <= int(idx) < arch.num_layers + mtp:
                return True
        # Qwen3-Next's multi-token-prediction head ("mtp.*") likewise.
        return (name.endswith("rotary_emb.inv_freq") or name.startswith("mtp.")
                or (name == "lm_head.weight" and arch.tie_word_embeddings)
                or any(name == t or (t.endswith(".") and name.startswith(t)) for t in ignored))

    layers, globals_ = _assemble(arch, {n: t for n, t in tensors.items() if not skip(n)}, NameMap(arch, "hf"),
                                 where=path)
    if online is not None:
        _quantize_online(online, layers, globals_)
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    return LoadedModel(
        name=path, arch=arch, layers=layers, globals=globals_,
        rope_inv_freq=inv_frequencies(arch.rope_dim, arch.rope_theta, arch.rope_scaling),
        tokenizer=TokenizerSource(path), generation_config=gen, rope_tables=_rope_tables(arch), vision=vision)


def _rope_tables(arch: ArchConfig) -> dict[str, np.ndarray]:
    """The model family's further frequency tables (``Family.rope_tables``: name -> theta, scaling)."""
    tables = get_family(arch.architecture).rope_tables
    if tables is None:
        return {}
    return {name: inv_frequencies(arch.rope_dim, theta, scaling) for name, (theta, scaling) in tables(arch).items()}


# The linear layers quantized checkpoints and online quantization quantize (embeddings,
# norms, routers and the stacked MoE experts stay float).
_LINEAR_PARAMS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def _check_quantization_flag(flag: str | None, method: str | None, path: str) -> str | None:
    """Refuses a ``--quantization`` the checkpoint is not; returns the online method to apply
    (``int8`` / ``fp8`` on a float checkpoint) or None."""
    if flag is None or flag == method:
        return None
    if flag in ONLINE and method is None:
        return flag
    if flag in ONLINE:
        raise ModelLoadError(f"--quantization {flag} quantizes a float checkpoint at load, but {path} is already "
                             f"quantized ({method}); omit --quantization or pass --quantization {method}")
    if flag == "gguf":
        raise ModelLoadError(f"--quantization gguf: {path} is not a GGUF file")
    raise ModelLoadError(f"--quantization {flag}: {path} is " +
                         (f"a {method} checkpoint" if method else "not a quantized checkpoint (config.json has "
                          "no quantization_config)") + "; omit --quantization to take what the checkpoint is")


def _quantize_online(method: str, layers: list[dict], globals_: dict) -> None:
    """Every float linear layer's matrix quantized in place by ``int_weights.ONLINE[method]``."""
    for params in (*layers, globals_):
        for name in _LINEAR_PARAMS:
            w = params.get(name)
            if w is not None and not is_quantized(w) and np.ndim(w) == 2:
                params[name] = ONLINE[method](w)


class NameMap:
    """Checkpoint tensor names <-> parameters of ``arch``, in format ``fmt`` ("hf" or "gguf"),
    from its model's parameter table: one lookup for every name a file holds, and the name
    a missing parameter is reported under."""

    def __init__(self, arch: ArchConfig, fmt: str):
        self.table = get_model_module(arch.architecture).PARAMS
        self.fmt = fmt
        # Pattern with its numeric components replaced by "#" -> (parameter, the placeholders
        # in order, chunk or None): a name is found by replacing its own numbers alike.
        self._by_key: dict[tuple[str, ...], list[tuple[Param, tuple[str, ...], Chunk | None]]] = {}
        self._first: dict[str, str] = {}
        for p in self.table.present(arch):
            if not p.from_checkpoint:
                continue
            patterns = p.patterns(arch, fmt)
            if not patterns:
                raise ModelLoadError(f"{arch.architecture}: {fmt} checkpoints have no name for parameter {p.name!r}")
            self._first[p.name] = _text(patterns[0])
            for pat in patterns:
                chunk = None if isinstance(pat, str) else pat
                parts = _text(pat).split(".")
                key = tuple("#" if c in _PLACEHOLDERS else c for c in parts)
                slots = tuple(c[1:-1] for c in parts if c in _PLACEHOLDERS)
                self._by_key.setdefault(key, []).append((p, slots, chunk))

    def lookup(self, name: str) -> list[tuple[Param, int | None, int | None, Chunk | Stored | None]]:
        """The parameters the tensor ``name`` gives: (parameter, layer, expert, chunk or stored
        form) for each (empty: not a parameter's name)."""
        parts = name.split(".")
        numeric = [c.isascii() and c.isdigit() for c in parts]
        key = tuple("#" if d else c for c, d in zip(parts, numeric))
        values = [int(c) for c, d in zip(parts, numeric) if d]
        out = []
        for p, slots, chunk in self._by_key.get(key, ()):
            at = dict(zip(slots, values))
            out.append((p, at.get("layer"), at.get("expert"), chunk))
        return out

    def name(self, param: str, layer: int | None = None, expert: int = 0) -> str:
        return self._first[param].format(layer=layer, expert=expert)


_PLACEHOLDERS = ("{layer}", "{expert}")


def _text(pattern: Pattern) -> str:
    return pattern if isinstance(pattern, str) else pattern.pattern


def _assemble(arch: ArchConfig, tensors: dict[str, tuple[np.ndarray, str]], names: NameMap, where: str,
              transform=None):
    """Places every tensor, checking that none is left over and none is missing.

    Per-expert tensors are stacked into their parameter, every expert of each layer required;
    a :class:`Stored` tensor is undone, its parts interleaved.  ``transform(param, array)``:
    applied to each tensor once its shape is checked."""
    E, L = arch.num_experts, arch.num_layers
    want = {p.name: tuple(p.shape(arch)) for p in names.table.present(arch) if p.from_checkpoint}
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(L)]
    globals_: dict[str, np.ndarray] = {}
    given: dict[tuple[int | None, str], str] = {}     # (layer, parameter) -> the tensor that gave it
    experts: dict[tuple[int, str], dict[int, tuple[np.ndarray, str]]] = {}
    parts: dict[tuple[int | None, str], dict[int, tuple[np.ndarray, str]]] = {}
    part_of: dict[str, Stored] = {}   # parameter -> its first part, for naming a missing one

    def place(layer, ours, arr, source):
        if (layer, ours) in given:
            raise ModelLoadError(f"{where}: tensor {source!r} gives {ours} of layer {layer} a second time "
                                 f"(also from {given[layer, ours]!r})")
        given[layer, ours] = source
        (globals_ if layer is None else layers[layer])[ours] = arr

    for name, (arr, fname) in tensors.items():
        hits = names.lookup(name)
        if not hits or any((layer is not None and layer >= L) or (expert is not None and expert >= E)
                           or not p.has(arch, layer) for p, layer, expert, _ in hits):
            experts_note = f" of {E} experts" if arch.is_moe else ""
            raise ModelLoadError(f"{where}: unexpected tensor {name!r} in {fname} (not a parameter of "
                                 f"{arch.architecture} with {L} layers{experts_note} in this config)")
        for p, layer, expert, form in hits:
            shape = want[p.name][1:] if expert is not None else want[p.name]
            stored = shape
            chunk = form if isinstance(form, Chunk) else None
            if chunk is not None:
                start, total = chunk.extent(arch, shape[chunk.axis])
                stored = tuple(total if i == chunk.axis else n for i, n in enumerate(shape))
            elif form is not None:
                stored = form.stored_shape(shape)
            if tuple(arr.shape) != stored:
                raise ModelLoadError(f"{where}: tensor {name!r} in {fname} has shape {tuple(arr.shape)}, "
                                     f"expected {stored}")
            a = arr
            if chunk is not None:
                if is_quantized(a):   # a packed weight (Phi-3's GGUF attn_qkv): its fields have the rows first
                    a = map_fields(a, lambda f, lo=start, hi=start + shape[0]: f[lo:hi], shape=tuple(shape))
                else:
                    a = a[(slice(None),) * chunk.axis + (slice(start, start + shape[chunk.axis]),)]
            elif form is not None:
                a = form.undo(a)
            if p.row_order is not None:
                rows = p.row_order(arch)
                # A quantized tensor's every field has the output rows first.
                a = map_fields(a, lambda f, rows=rows: f[rows]) if is_quantized(a) else a[rows]
            if transform is not None:
                a = transform(p, a)
            if expert is not None and is_quantized(a):
                raise ModelLoadError(f"{where}: tensor {name!r} is a quantized expert weight; quantized "
                                     "mixture-of-experts layers are not supported")
            if expert is not None:
                experts.setdefault((layer, p.name), {})[expert] = (a, name)
            elif isinstance(form, Stored) and form.parts > 1:
                parts.setdefault((layer, p.name), {})[form.part] = (a, name)
                part_of.setdefault(p.name, form)
            else:
                place(layer, p.name, a, name)
    for (layer, ours), got in sorted(experts.items()):
        missing = [e for e in range(E) if e not in got]
        if missing:
            raise ModelLoadError(f"{where}: missing tensor {names.name(ours, layer, missing[0])!r} "
                                 f"(layer {layer} has {len(got)} of {E} experts' {ours.split('_')[1]} projections)")
        place(layer, ours, np.stack([got[e][0] for e in range(E)]), got[0][1])
    for (layer, ours), got in sorted(parts.items(), key=lambda kv: (-1 if kv[0][0] is None else kv[0][0], kv[0][1])):
        n = part_of[ours].parts
        for i in range(n):
            if i not in got:
                pattern = next(f for f in names.table[ours].patterns(arch, names.fmt)
                               if isinstance(f, Stored) and f.part == i)
                raise ModelLoadError(f"{where}: missing tensor {pattern.pattern.format(layer=layer)!r}")
        place(layer, ours, interleave([got[i][0] for i in range(n)]), got[0][1])
    for p in names.table.present(arch):
        if not p.from_checkpoint:
            continue
        for layer in ([None] if p.scope == GLOBAL else range(L)):
            if (layer, p.name) not in given and p.has(arch, layer):
                raise ModelLoadError(f"{where}: missing tensor {names.name(p.name, layer)!r}")
    return layers, globals_


# ------------------------------------------------------------------ GGUF

# llama.cpp permutes Q/K rows (weights and biases) for the architectures it runs with
# interleaved RoPE, i.e. as Llama; the parameters with ``rope_heads`` are unpermuted for these.
ROPE_PERMUTED = ("llama", "mistral", "smollm3", "granite")

# Tensors that configure the model rather than weigh in it: read into the config, not placed.
_CONFIG_TENSORS = ("rope_freqs.weight", *PHI3_FACTORS)


def load_gguf(path: str, name: str | None = None, dequantize: bool = False) -> LoadedModel:
    """A GGUF file's model.  Its quantized and 16-bit matrices stay in their blocks
    (``quant/gguf_blocks.PackedWeight``, the file's bytes), as llama.cpp and vLLM serve them;
    ``dequantize``: every tensor as float32 instead (the path that is token-exact against
    transformers on the dequantized weights).  The family's parameter table names the
    tensors and says what the converter did to them; everything else is this one loop."""
    # Our own container parser (gguf.GGUFReader takes seconds on a tokenizer's string
    # arrays); it raises ModelLoadError naming the file for anything malformed.
    reader = read_gguf(path)
    gguf_name = reader.fields.get("general.architecture")
    if gguf_name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {gguf_name!r} is not supported; "
                             f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    by_name = {t.name: t for t in reader.tensors}

    def read(name: str) -> np.ndarray:   # a tensor that configures the model (Phi-3's LongRoPE factors)
        # Imported only once a GGUF file is read: an install without the gguf package loads HF folders.
        from gguf.quants import dequantize as gguf_dequantize
        t = by_name[name]
        return gguf_dequantize(t.data, t.tensor_type)

    arch = read_gguf_config(reader.fields, {n: t.shape for n, t in by_name.items()}, path, read)
    names_map = NameMap(arch, "gguf")
    # GLM-4-MoE's multi-token-prediction block(s), nextn.* included, follow the decoder's
    # layers (transformers skips them too: no speculative decoding here).
    nextn = int(reader.fields.get(f"{gguf_name}.nextn_predict_layers") or 0)

    def skip(t) -> bool:
        if t.name in _CONFIG_TENSORS:
            return True
        parts = t.name.split(".")
        return bool(nextn and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= arch.num_layers)

    def keep_packed(t) -> bool:
        hits = names_map.lookup(t.name)
        # a tensor the converter changed beyond rows (Stored) is decoded to float32
        return (not any(isinstance(form, Stored) for *_, form in hits)
                and gguf_tensors.keeps_packed(t, [p for p, *_ in hits], arch, dequantize))

    freq_factors = None
    if "rope_freqs.weight" in by_name:   # Llama 3's rope scaling, as per-frequency divisors
        freq_factors = gguf_tensors.dequantize_all([by_name["rope_freqs.weight"]], path)["rope_freqs.weight"]
        freq_factors = freq_factors.reshape(-1)
    base = os.path.basename(path)
    todo = [(t, keep_packed(t)) for t in reader.tensors if not skip(t)]
    floats = gguf_tensors.dequantize_all([t for t, packed in todo if not packed], path)
    tensors: dict[str, tuple[np.ndarray, str]] = {}   # in file order, packed or not
    for t, packed in todo:
        # GGUF lists dimensions innermost first: (in, out) for a [out, in] matrix
        shape = tuple(int(n) for n in reversed(t.shape))
        if not packed:
            tensors[t.name] = (floats.pop(t.name).reshape(shape), base)
            continue
        if len(shape) != 2:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has shape {shape}, expected a matrix")
        tensors[t.name] = (gguf_blocks.pack(t.data, t.tensor_type, shape), base)

    permuted = gguf_name in ROPE_PERMUTED

    def transform(p: Param, arr):
        if not (permuted and p.rope_heads):
            return arr
        # a packed weight's fields all have the rows first: each is permuted alike
        return gguf_tensors.map_rows(arr, lambda a: gguf_tensors.unpermute_rope_rows(a, p.rope_heads(arch)))

    layers, globals_ = _assemble(arch, tensors, names_map, where=path, transform=transform)
    return LoadedModel(
        name=name or path, arch=arch, layers=layers, globals=globals_,
        rope_inv_freq=inv_frequencies(arch.rope_dim, arch.rope_theta, arch.rope_scaling, freq_factors),
        tokenizer=TokenizerSource(os.path.dirname(os.path.abspath(path)), gguf_file=base),
        generation_config={}, rope_tables=_rope_tables(arch))


# ------------------------------------------------------------------ entry point

def load_model(model: str | None, dequantize: bool = False, quantization: str | None = None) -> LoadedModel:
    """Loads ``model`` (an HF folder, a .gguf file, or None for the built-in model); a GGUF's
    quantized weights stay packed unless ``dequantize``; ``quantization``: ``--quantization``
    (checked against an HF checkpoint, or applied to a float one: see :func:`load_hf_folder`).
    A Python package the format needs and the install lacks is named, with how to install it."""
    try:
        return _load_model(model, dequantize, quantization)
    except ImportError as e:   # ModuleNotFoundError too: name the package, not who imported it
        package = (e.name or "").split(".")[0]
        if not package:
            raise
        raise ModelLoadError(f"{model or 'the built-in model'}: loading it needs the Python package {package!r}, "
                             f"which is missing or cannot be imported ({e}); install it with "
                             f"`pip install {package}`") from None


def gguf_file(model: str | None) -> str | None:
    """The GGUF file ``load_model(model)`` reads, None for an HF folder; a path that is
    neither is refused here, naming it."""
    if model is None:
        return builtin_gguf_path()
    if not os.path.exists(model):
        raise ModelLoadError(f"model path {model!r} does not exist (pass a local HF folder or .gguf file, "
                             f"a Hub repo id such as org/name, or omit it for the built-in model)")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ModelLoadError(f"{model}: a model file must be a .gguf (or pass an HF folder)")
        return model
    ggufs = [f for f in os.listdir(model) if f.endswith(".gguf")]
    if not os.path.isfile(os.path.join(model, "config.json")) and len(ggufs) == 1:
        return os.path.join(model, ggufs[0])
    return None


def _load_model(model: str | None, dequantize: bool, quantization: str | None = None) -> LoadedModel:
    path = gguf_file(model)
    if path is None:
        if dequantize:
            raise ModelLoadError(f"--dequantize loads a GGUF file's blocks as float weights; {model} is an HF folder")
        return load_hf_folder(model, quantization)
    if model is None:
        return load_gguf(path, name=BUILTIN_MODEL_NAME, dequantize=dequantize)
    return load_gguf(path, name=None if os.path.isfile(model) else model, dequantize=dequantize)
