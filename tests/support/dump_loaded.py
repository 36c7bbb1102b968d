"""Dumps every array the loader produces for each registered architecture's tiny checkpoint
(HF folder, and GGUF F32 / Q8_0 / dequantized where the family has a GGUF form) and for the
built-in SmolLM2 GGUF, so that a refactor of ``jaxllm/models`` can be proven bit-identical.

    python tests/support/dump_loaded.py OUT_DIR [--compare BEFORE_DIR] [--only NAME,...]

Each case is written as ``OUT_DIR/<case>.pkl``: {"arch": repr(ArchConfig), "arrays":
{name: (dtype, shape, bytes)}}; ``--compare`` reports every case and array that differs.  The
configs are compared as flat views (every leaf field's value by name, a family's nested section
such as ``arch.mla`` spread out, an absent one as its defaults), so that a field moving into a
section compares equal while any value that changes does not.
Checkpoints are built under ``OUT_DIR/ckpt`` (reused when present: the same seed builds the
same bytes, so before and after read identical files when pointed at one ckpt folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)


def _flatten(prefix: str, a, out: dict) -> None:
    from jaxllm.quant import ops
    if ops.is_quantized(a):
        out[prefix + "#type"] = ("meta", repr((type(a).__name__, getattr(a, "type_name", None),
                                               tuple(a.shape), getattr(a, "interleaved", None),
                                               getattr(a, "format", None), getattr(a, "group_size", None))), b"")
        for k, v in ops._fields(a).items():
            v = np.asarray(v)
            out[f"{prefix}#{k}"] = (str(v.dtype), v.shape, v.tobytes())
    else:
        v = np.asarray(a)
        out[prefix] = (str(v.dtype), v.shape, v.tobytes())


def _sections() -> dict:
    """ArchConfig field -> the type of a nested per-family section."""
    from jaxllm.models.config import MoeRouting
    from jaxllm.models.deepseek import DeepseekConfig
    from jaxllm.models.gemma import GemmaConfig
    from jaxllm.models.gpt_oss import GptOssConfig
    from jaxllm.models.llama import LlamaConfig
    return {"moe": MoeRouting, "variant": LlamaConfig, "gemma": GemmaConfig, "gpt_oss": GptOssConfig,
            "mla": DeepseekConfig}


def flat_arch(arch) -> dict:
    """name -> repr(value) of every leaf field of ``arch`` (an ArchConfig, or the dict of a parsed
    older repr), each section's fields under their own names (None: the section's defaults)."""
    sections = _sections()
    items = arch.items() if isinstance(arch, dict) else ((f.name, getattr(arch, f.name))
                                                         for f in dataclasses.fields(arch))
    out = {"__type__": arch.get("__type__") if isinstance(arch, dict) else type(arch).__name__}
    for name, v in items:
        if name == "__type__":
            continue
        if name in sections:
            sec = sections[name]() if v is None else v
            out.update({f.name: repr(getattr(sec, f.name)) for f in dataclasses.fields(sec)})
        else:
            out[name] = repr(v)
    return out


def parse_arch(text: str) -> dict:
    """The fields of an ArchConfig repr (written by an older tree, whose fields may have moved)."""
    from jaxllm.layers.rotary import RopeScaling
    from jaxllm.models.qwen3_next import HybridConfig

    def record(kind):
        return lambda **kw: {"__type__": kind, **kw}
    ns = {"ArchConfig": record("ArchConfig"), "HybridArch": record("HybridArch"), "RopeScaling": RopeScaling,
          "HybridConfig": HybridConfig, "inf": math.inf, "nan": math.nan}
    return eval(text, ns)   # our own dumps' text only


def dump_loaded(m) -> dict:
    arrays: dict = {}
    for k, a in m.globals.items():
        _flatten(f"g.{k}", a, arrays)
    for i, lp in enumerate(m.layers):
        for k, a in lp.items():
            _flatten(f"l{i}.{k}", a, arrays)
    _flatten("rope_inv_freq", m.rope_inv_freq, arrays)
    for k, a in (m.rope_tables or {}).items():
        _flatten(f"rope.{k}", a, arrays)
    return {"arch": repr(m.arch), "arrays": arrays, "generation_config": repr(m.generation_config),
            "tokenizer": repr(m.tokenizer and (os.path.basename(m.tokenizer.path), m.tokenizer.gguf_file))}


def _cases(ckpt: str):
    """(case name, callable that loads it)."""
    import gguf

    from jaxllm.models.loader import load_model
    from support import tiny_families
    from support import tiny_hybrid
    from support import tiny_models
    from support import gguf_convert

    os.makedirs(ckpt, exist_ok=True)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def built(name, make):
        path = os.path.join(ckpt, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            make(path)
        return path

    def gguf_file(name, make):
        path = os.path.join(ckpt, name)
        if not os.path.exists(path):
            make(path)
        return path

    all_variants = {**tiny_models.VARIANTS, **tiny_models.VARIANTS_B, **tiny_models.VARIANTS_MLA,
                    **tiny_families.FAMILY_VARIANTS}
    for v in all_variants:
        hf = built(v, lambda p, v=v: tiny_models.build_tiny(v, p, variants=all_variants))
        yield f"hf.{v}", lambda hf=hf: load_model(hf)
        cfg_arch = None
        import json
        with open(os.path.join(hf, "config.json")) as f:
            cfg_arch = json.load(f)["architectures"][0]
        if v.startswith(("llama", "mistral")):   # tiny_models.write_gguf: no biases, no q/k norm
            # llama.cpp's "llama" layout (q/k permuted), F32 and Q8_0 matrices
            g = gguf_file(f"{v}.gguf", lambda p, hf=hf: tiny_models.write_gguf(hf, p))
            gq = gguf_file(f"{v}-q8_0.gguf", lambda p, hf=hf: tiny_models.write_gguf(hf, p, matrix_type=q8))
        elif cfg_arch in gguf_convert.GGUF_ARCH:
            try:
                g = gguf_file(f"{v}.gguf", lambda p, hf=hf: gguf_convert.write_gguf(hf, p))
                gq = gguf_file(f"{v}-q8_0.gguf", lambda p, hf=hf: gguf_convert.write_gguf(hf, p, matrix_type=q8))
            except Exception as e:   # an option a GGUF cannot carry
                print(f"  {v}: no GGUF ({type(e).__name__}: {str(e)[:100]})", file=sys.stderr)
                continue
        else:
            continue
        yield f"gguf.{v}", lambda g=g: load_model(g)
        yield f"gguf-q8.{v}", lambda gq=gq: load_model(gq)
        yield f"gguf-q8-deq.{v}", lambda gq=gq: load_model(gq, dequantize=True)
    # The GGUF-compatible variants of the families whose tiny options a GGUF cannot carry.
    sys.path.insert(0, os.path.join(TESTS, "models"))
    from test_gguf_families import GGUF_VARIANTS
    for v in ("gemma2", "gemma3", "gpt_oss", "smollm3"):
        hf = built(f"ggufv-{v}", lambda p, v=v: tiny_models.build_tiny(v, p, variants=GGUF_VARIANTS))
        g = gguf_file(f"ggufv-{v}.gguf", lambda p, hf=hf: gguf_convert.write_gguf(hf, p))
        gq = gguf_file(f"ggufv-{v}-q8_0.gguf", lambda p, hf=hf: gguf_convert.write_gguf(hf, p, matrix_type=q8))
        yield f"hf.ggufv-{v}", lambda hf=hf: load_model(hf)
        yield f"gguf.ggufv-{v}", lambda g=g: load_model(g)
        yield f"gguf-q8.ggufv-{v}", lambda gq=gq: load_model(gq)
        yield f"gguf-q8-deq.ggufv-{v}", lambda gq=gq: load_model(gq, dequantize=True)
    for arch in tiny_hybrid.VARIANTS:
        hf = built(arch, lambda p, arch=arch: tiny_hybrid.build(arch, p))
        yield f"hf.{arch}", lambda hf=hf: load_model(hf)
    yield "builtin", lambda: load_model(None)
    yield "builtin-deq", lambda: load_model(None, dequantize=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--compare")
    ap.add_argument("--ckpt", help="checkpoint folder (default OUT/ckpt)")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    only = [s for s in args.only.split(",") if s]
    bad = 0
    for case, load in _cases(args.ckpt or os.path.join(args.out, "ckpt")):
        if only and not any(o in case for o in only):
            continue
        m = load()
        load_arch = [m.arch]
        d = dump_loaded(m)
        with open(os.path.join(args.out, f"{case}.pkl"), "wb") as f:
            pickle.dump(d, f)
        msg = f"{case}: {len(d['arrays'])} arrays"
        if args.compare:
            with open(os.path.join(args.compare, f"{case}.pkl"), "rb") as f:
                old = pickle.load(f)
            diffs = [k for k in ("generation_config", "tokenizer") if old[k] != d[k]]
            old_arch, new_arch = flat_arch(parse_arch(old["arch"])), flat_arch(load_arch[0])
            diffs += [f"arch.{k}" for k in sorted(set(old_arch) | set(new_arch)) if old_arch.get(k) != new_arch.get(k)]
            keys = set(old["arrays"]) | set(d["arrays"])
            diffs += [k for k in sorted(keys) if old["arrays"].get(k) != d["arrays"].get(k)]
            bad += bool(diffs)
            msg += " IDENTICAL" if not diffs else f" DIFFERS: {diffs[:8]}"
        print(msg, flush=True)
    if args.compare:
        print("ALL IDENTICAL" if not bad else f"{bad} CASES DIFFER")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
