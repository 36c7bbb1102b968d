"""The package's import layering, read from the source with ``ast`` (nothing is imported).

Three rules (docs/architecture.md, "Layers"; issue 36):

* **Kernels at the bottom.** A module of ``jaxllm/pallas`` or ``jaxllm/cpu`` imports only
  jax, numpy, the standard library, other kernel modules and the leaf format modules listed
  in :data:`LEAF_MODULES` (which themselves import nothing of jaxllm but each other).
* **Imports at module top.** No function-local import of a jaxllm module: one that exists to
  dodge a cycle means the layering is wrong.  Third-party imports are not checked here.
* **No import circle** among jaxllm modules.

The graph holds every ``import`` / ``from ... import`` of a jaxllm module, at module level or
inside a function, with relative imports resolved.  ``from P import n`` is an edge to the
module ``P.n`` where that is a module, else to ``P``.  Importing ``a.b.c`` also runs the
packages ``a.b`` and ``a`` (their ``__init__``), so an edge goes to each of them too, except
to the importer's own packages (already running when it is imported) and to ``jaxllm``
itself, whose ``__init__`` imports nothing at load (its public names are loaded on first
use, see :data:`LOCAL_IMPORT_ALLOWED`).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "jaxllm"

KERNEL_PACKAGES = ("jaxllm.pallas", "jaxllm.cpu")

LEAF_MODULES = {
    "jaxllm.formats": "the package of the formats below",
    "jaxllm.formats.storage": "bf16 kept as uint16 bit patterns on CPU",
    "jaxllm.formats.kv_pages": "the KV cache's page formats (QuantPages, quantize / dequantize)",
    "jaxllm.formats.int_weights": "weight-only quantized linear weights (QuantizedLinear)",
    "jaxllm.formats.gdn_inputs": "the gated delta rule's input preparation",
    "jaxllm.formats.numerics": "exactly rounded float recipes shared by jnp and numpy",
    "jaxllm.formats.gumbel": "the counter-based Gumbel noise recipe",
    "jaxllm.paths": "where jaxllm keeps files between runs",
    "jaxllm.cache_files": "atomic writes and seals of cache entries (the native kernels use it)",
}
"""Modules the kernels may import beside their own packages: each imports nothing of jaxllm
except other modules of this list."""

LOCAL_IMPORT_ALLOWED = {
    # PEP 562: ``import jaxllm`` stays free of JAX, so the pure-Python parts (core/,
    # sampling_params) load without it; LLM and SamplingParams are imported on first use.
    ("jaxllm", "jaxllm.llm"): "lazy public name (PEP 562)",
    ("jaxllm", "jaxllm.sampling_params"): "lazy public name (PEP 562)",
    ("jaxllm", "jaxllm.outputs"): "lazy public name (PEP 562)",
    ("jaxllm", "jaxllm.lora.request"): "lazy public name (PEP 562)",
    ("jaxllm", "jaxllm.pooling.params"): "lazy public name (PEP 562)",
    # The command line builds its parser without the engine: `jaxllm --help` and a flag error
    # answer without importing JAX (~60 ms instead of ~4 s); a command imports what it runs.
    ("jaxllm.cli", "jaxllm.llm"): "the engine, imported by the command that starts it",
    ("jaxllm.cli", "jaxllm.engine.output_processor"): "the engine, imported by the command that starts it",
    ("jaxllm.cli", "jaxllm.engine.render"): "the engine, imported by the command that starts it",
    # Inside load_tokenizer's try: the GGUF converter needs gguf / tokenizers, and a missing
    # package must be a ModelLoadError naming it (tests/models/test_gguf_tokenizer.py).
    ("jaxllm.engine.tokenizer", "jaxllm.engine.gguf_tokenizer"): "optional packages, named when missing",
}
"""(importing module, imported module) pairs whose function-local import is allowed, each
with its reason."""

LOCAL_IMPORT_ALLOWED_PACKAGES: dict[str, str] = {}
"""Packages whose own function-local imports are not checked yet, with the reason."""

CYCLE_ALLOWED_PACKAGES: dict[str, str] = {}
"""A circle whose members all lie in these packages is tolerated for now."""


@dataclass(frozen=True)
class Edge:
    source: str          # importing module
    target: str          # imported module (or one of its packages)
    path: str            # the importer's file, relative to the repository
    line: int
    local: bool          # inside a function
    implicit: bool       # to a package the import runs (its __init__), not to the module it names
    text: str            # the import as written


def _module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, str]:
    """module name -> path relative to the repository, for every .py file under jaxllm/."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)
                out[_module_name(rel)] = rel
    return out


def _packages_of(name: str) -> list[str]:
    """``a.b.c`` -> [``a``, ``a.b``]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name ``from <node.module> import ...`` names inside ``source``."""
    if not node.level:
        return node.module
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _in_function(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def _known(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is a jaxllm module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def import_graph() -> tuple[dict[str, str], list[Edge]]:
    modules = _modules()
    edges = []
    for source, rel in modules.items():
        with open(os.path.join(ROOT, rel)) as f:
            source_text = f.read()
        tree = ast.parse(source_text, rel)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        is_package = rel.endswith("__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [_known(a.name, modules) for a in node.names if a.name.split(".")[0] == PACKAGE]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(source, is_package, node)
                if base is None or base.split(".")[0] != PACKAGE:
                    continue
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _known(base, modules)
                           for a in node.names]
            else:
                continue
            local = _in_function(node, parents)
            text = ast.get_source_segment(source_text, node) or ast.dump(node)
            own = set(_packages_of(source)) | {source}
            for target in dict.fromkeys(t for t in targets if t):
                for t in [*_packages_of(target)[1:], target]:   # the packages it runs, then the module
                    if t not in own:
                        edges.append(Edge(source, t, rel, node.lineno, local, t != target, " ".join(text.split())))
    return modules, edges


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _where(e: Edge) -> str:
    return f"  {e.path}:{e.line}: {e.source} -> {e.target}   ({e.text})"


def test_kernels_import_only_kernels_and_leaf_formats(graph):
    """pallas/ and cpu/ import nothing of the engine above them (layers, models, sample,
    quant, config, ...): only each other and the leaf format modules."""
    modules, edges = graph
    bad = [e for e in edges
           if any(_under(e.source, p) for p in KERNEL_PACKAGES)
           and not any(_under(e.target, p) for p in KERNEL_PACKAGES) and e.target not in LEAF_MODULES]
    bad = list({(e.path, e.line): e for e in bad}.values())   # one line per import statement
    assert not bad, ("kernel modules import upward (a kernel may import only jax, numpy, the standard library, "
                     "pallas/, cpu/ and the leaf modules " + ", ".join(sorted(LEAF_MODULES)) + "):\n"
                     + "\n".join(map(_where, bad)))


def test_leaf_modules_are_leaves(graph):
    """The leaf format modules exist and import nothing of jaxllm except each other."""
    modules, edges = graph
    missing = sorted(set(LEAF_MODULES) - set(modules))
    assert not missing, f"LEAF_MODULES names modules that do not exist: {missing}"
    bad = [e for e in edges if e.source in LEAF_MODULES and e.target not in LEAF_MODULES]
    assert not bad, "leaf modules must import nothing of jaxllm but each other:\n" + "\n".join(map(_where, bad))


def test_no_function_local_jaxllm_imports(graph):
    """Imports of jaxllm modules sit at module top (an import placed inside a function to
    dodge a cycle means the layering is wrong); see LOCAL_IMPORT_ALLOWED for the exceptions."""
    modules, edges = graph
    bad = [e for e in edges
           if e.local and not e.implicit and (e.source, e.target) not in LOCAL_IMPORT_ALLOWED
           and not any(_under(e.source, p) for p in LOCAL_IMPORT_ALLOWED_PACKAGES)]
    assert not bad, (f"{len(bad)} function-local imports of jaxllm modules (move them to the module top; "
                     "a cycle that forbids it is a layering error to fix):\n" + "\n".join(map(_where, bad)))
    stale = [k for k in LOCAL_IMPORT_ALLOWED
             if not any(e.local and not e.implicit and (e.source, e.target) == k for e in edges)]
    assert not stale, f"LOCAL_IMPORT_ALLOWED entries that no longer occur (remove them): {stale}"


def _cycles(nodes, succ) -> list[list[str]]:
    """Strongly connected components with more than one member (or a self-loop), by Tarjan."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        # iterative depth-first search: the package has more modules than Python's default recursion likes
        work = [(v, iter(sorted(succ.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1 or node in succ.get(node, ()):
                        out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _one_circle(comp: list[str], succ) -> list[str]:
    """A shortest circle through the component's first member, for the message."""
    start, members = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(succ.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_no_import_cycles(graph):
    """No circle in the module import graph (top-level and function-local imports alike)."""
    modules, edges = graph
    succ: dict[str, set[str]] = {}
    sites: dict[tuple[str, str], Edge] = {}
    for e in edges:
        succ.setdefault(e.source, set()).add(e.target)
        sites.setdefault((e.source, e.target), e)
    bad = [c for c in _cycles(modules, succ)
           if not all(any(_under(m, p) for p in CYCLE_ALLOWED_PACKAGES) for m in c)]
    msgs = []
    for comp in bad:
        circle = _one_circle(comp, succ)
        hops = "\n".join(_where(sites[(a, b)]) for a, b in zip(circle, circle[1:]))
        msgs.append(f"a circle of {len(comp)} modules: {', '.join(comp)}\n one circle through them:\n{hops}")
    assert not bad, f"{len(bad)} import circles among jaxllm modules:\n" + "\n\n".join(msgs)
