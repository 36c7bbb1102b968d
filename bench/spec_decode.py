"""``jaxllm bench spec-decode``: output tokens/s with ngram speculation against without, offline.

    jaxllm bench spec-decode [--model M] [--ks 2,4,8] [--concurrency 1,4,8] [--repeats 3]
                             [--prompt-lookup-min 2] [--prompt-lookup-max 5] [--output-json F]
                             [--draft-layers N --draft-ks 2,4]

Three workloads on the same engines:

* ``edit``: code editing on a long prompt that holds most of the answer: a 60-line Python
  module (about 610 prompt tokens with the chat template) with one method to rename, output whole; greedy, ended
  by EOS or 480 tokens;
* ``copy``: short chat requests whose answer is mostly in the prompt (rewrite two small
  functions with one renamed; copy a list of names), greedy, ended by EOS or 160 tokens;
* ``random``: prompts of random token ids, 64 output tokens (``ignore_eos``), greedy: ngram
  rarely finds anything to propose, and what it proposes is rarely right, so this measures
  what speculation costs when it cannot help (the off-switch's case).

With ``--draft-layers N`` the same workloads also run ``draft_model`` arms, the draft being
the built-in model's first N layers with its final norm and head (``truncated_gguf``: no
smaller checkpoint of its vocabulary is available offline).

For every concurrency c, c requests run together to completion; output tokens/s is their
output tokens over the wall time.  One engine per arm (off, and ngram with each k), all
built before measuring, each arm's buckets compiled by a warm-up run; the arms alternate
within every repeat (the machine is shared: ratios of alternated runs are what hold), and
the report is the median over repeats.  Outputs are checked equal to the off arm's (the
identity speculation promises), and the acceptance length is 1 + accepted / verifications.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.offline import _check_json_path, random_prompts

NAMES = ["Alice Johnson", "Bob Smith", "Carol White", "David Brown", "Eve Davis", "Frank Miller", "Grace Wilson",
         "Henry Moore", "Irene Clark", "Jack Lewis", "Karen Hall", "Leo Young"]


def truncated_gguf(src: str, num_layers: int, dst: str) -> str:
    """A draft checkpoint made of ``src``'s first ``num_layers`` layers, its final norm and head
    (an early-exit draft: the same vocabulary and embedding, no training), written to ``dst``.
    No smaller checkpoint of the built-in model's vocabulary is available offline."""
    import re

    import gguf
    r = gguf.GGUFReader(src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    blocks = f"{arch}.block_count"
    have = r.fields[blocks].contents()
    if not 1 <= num_layers < have:
        raise SystemExit(f"--draft-layers: expected 1..{have - 1} (the model has {have} layers), got {num_layers}")
    w = gguf.GGUFWriter(dst, arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, num_layers if f.name == blocks else f.contents(), vtype, sub_type=sub)
    keep = [t for t in r.tensors
            if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < num_layers]
    for t in keep:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(t.data)
    w.close()
    return dst


def register(subparsers) -> None:
    p = subparsers.add_parser("spec-decode", help="output tokens/s with ngram speculation vs without",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--ks", default="2,4,8", help="num_speculative_tokens of the ngram arms")
    p.add_argument("--concurrency", default="1,4,8", help="requests running together")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each arm (default 3)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--workloads", default="edit,copy,random")
    p.add_argument("--draft-layers", type=int, default=0, metavar="N",
                   help="also run draft_model arms: a draft of the built-in model's first N layers (0: none)")
    p.add_argument("--draft-ks", default="2,4", help="num_speculative_tokens of the draft_model arms")
    p.add_argument("--cpu-matmul", default="auto",
                   help="every arm's --cpu-matmul (default auto: float32 activations, as native); with another, "
                        "the default's arm without speculation is timed too, as 'off, auto'")
    p.add_argument("--output-json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_spec_decode)


def copy_messages(i: int) -> list[dict]:
    """The i-th copy-heavy request: most of its answer is in its prompt."""
    if i % 2 == 0:
        f, g = ("total_price", "average_price") if i % 4 == 0 else ("order_cost", "mean_cost")
        code = (f"def {f}(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
                f"        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
                f"    return subtotal + tax\n\n\ndef {g}(items):\n    if not items:\n        return 0\n"
                f"    return sum(item.price for item in items) / len(items)\n")
        return [{"role": "user", "content": f"Rewrite this Python code, renaming the function {f} to "
                                            f"compute_{i}. Output only the code.\n\n{code}"}]
    names = NAMES[i % 5:] + NAMES[:i % 5]
    return [{"role": "user", "content": "Copy this list exactly, one name per line:\n" + "\n".join(names) + "\n"}]


# The long module of the ``edit`` workload (METHOD: the method to rename).
MODULE = '''"""Inventory records for a small shop: items, stock levels and reorders."""

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list = field(default_factory=list)


class Inventory:
    def __init__(self):
        self.items = {}
        self.history = []

    def add_item(self, item):
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item
        self.history.append(("add", item.sku, item.quantity))

    def remove_item(self, sku):
        item = self.items.pop(sku)
        self.history.append(("remove", sku, item.quantity))
        return item

    def restock(self, sku, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.items[sku].quantity += amount
        self.history.append(("restock", sku, amount))

    def sell(self, sku, amount):
        item = self.items[sku]
        if item.quantity < amount:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= amount
        self.history.append(("sell", sku, amount))
        return amount * item.price

    def METHOD(self):
        return sum(item.price * item.quantity for item in self.items.values())

    def low_stock(self, threshold=5):
        return [item for item in self.items.values() if item.quantity < threshold]

    def by_tag(self, tag):
        return [item for item in self.items.values() if tag in item.tags]


def reorder_list(inventory, threshold=5, target=20):
    orders = []
    for item in inventory.low_stock(threshold):
        orders.append((item.sku, target - item.quantity))
    return orders


def report(inventory):
    lines = [f"{len(inventory.items)} items, value {inventory.METHOD():.2f}"]
    for sku, amount in reorder_list(inventory):
        lines.append(f"reorder {sku}: {amount}")
    return "\\n".join(lines)
'''
RENAMES = [("total_value", "stock_value"), ("inventory_value", "value_on_hand"), ("value", "worth"),
           ("stock_total", "total_worth")]


def edit_messages(i: int) -> list[dict]:
    """The i-th long code-editing request: a 60-line module with one method renamed."""
    old, new = RENAMES[i % len(RENAMES)]
    return [{"role": "user", "content": f"{MODULE.replace('METHOD', old)}\n\nRewrite the code above, renaming the method "
                                        f"{old} to {new}. Output only the code."}]


def workload(name: str, tok, c: int, vocab: int, round_: int):
    from jaxllm import SamplingParams
    if name == "edit":
        prompts = [{"prompt_token_ids": tok.apply_chat_template(edit_messages(round_ * 8 + i), add_generation_prompt=True,
                                                                tokenize=True, return_dict=False)} for i in range(c)]
        return prompts, SamplingParams(temperature=0, max_tokens=480)
    if name == "copy":
        prompts = [{"prompt_token_ids": tok.apply_chat_template(copy_messages(round_ * 8 + i), add_generation_prompt=True,
                                                                tokenize=True, return_dict=False)} for i in range(c)]
        return prompts, SamplingParams(temperature=0, max_tokens=160)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(c, 128, vocab, 1000 * round_ + c)]
    return prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def run(llm, prompts, params) -> tuple[float, list, tuple]:
    s = llm.llm_engine.core.scheduler.spec_stats
    before = (s.num_drafts, s.num_accepted_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, toks)) / dt, toks, (s.num_drafts - before[0], s.num_accepted_tokens - before[1])


def cmd_spec_decode(args: argparse.Namespace) -> int:
    from jaxllm import LLM
    _check_json_path(args.output_json)
    ks = [int(k) for k in args.ks.split(",")]
    cs = [int(c) for c in args.concurrency.split(",")]
    arms = {"off": None}
    for k in ks:
        arms[f"k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
                          "prompt_lookup_max": args.prompt_lookup_max}
    if args.draft_layers:
        import tempfile

        from jaxllm.models.builtin import builtin_gguf_path
        if args.model is not None:
            raise SystemExit("--draft-layers: drafts are cut from the built-in model; leave --model out")
        draft = truncated_gguf(builtin_gguf_path(), args.draft_layers,
                               os.path.join(tempfile.mkdtemp(prefix="jaxllm-draft-"), "draft.gguf"))
        for k in (int(k) for k in args.draft_ks.split(",")):
            arms[f"draft {args.draft_layers}L k={k}"] = {"method": "draft_model", "model": draft,
                                                        "num_speculative_tokens": k}
    # Every bucket compiled up front, and a step that compiles fails: none may in a measured run.
    common = dict(max_num_seqs=max(cs), max_model_len=2048, show_progress=False, precompile="all",
                  strict_compile_guard=True)
    engines = {a: LLM(args.model, speculative_config=spec, cpu_matmul=args.cpu_matmul, **common)
               for a, spec in arms.items()}
    # What a user gets without speculation at the defaults, when that is not the off arm's
    # arithmetic: timed beside the arms, outside the identity check.
    if args.cpu_matmul != "auto":
        default_off = LLM(args.model, **common)
        if default_off.llm_engine.core.runner.cfg.kernels != engines["off"].llm_engine.core.runner.cfg.kernels:
            engines["off, auto"] = default_off
            arms["off, auto"] = None
        else:
            del default_off
    tok = engines["off"].get_tokenizer()
    vocab = engines["off"].llm_engine.arch.vocab_size
    results = []
    for name in args.workloads.split(","):
        for c in cs:
            for llm in engines.values():      # warm-up: compiles the buckets this workload needs
                run(llm, *workload(name, tok, c, vocab, 99))
            tps = {a: [] for a in arms}
            acc = {a: [0, 0] for a in arms}
            for r in range(args.repeats):
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                ref = {}
                for a in order:
                    t, toks, (drafts, accepted) = run(engines[a], *workload(name, tok, c, vocab, r))
                    ref[a] = toks
                    tps[a].append(t)
                    acc[a][0] += drafts
                    acc[a][1] += accepted
                for a in arms:
                    if a != "off, auto" and ref[a] != ref["off"]:
                        raise SystemExit(f"{name} c={c} {a}: outputs differ from speculation off")
            off = statistics.median(tps["off"])
            for a in arms:
                med = statistics.median(tps[a])
                d, n = acc[a]
                results.append(dict(workload=name, concurrency=c, arm=a, output_tok_s=med, ratio=med / off,
                                    acceptance_length=1 + n / d if d else None, runs=tps[a]))
    print(f"\n{engines['off'].llm_engine.model_name}, ngram prompt_lookup {args.prompt_lookup_min}-"
          f"{args.prompt_lookup_max}, --cpu-matmul {args.cpu_matmul}, median of {args.repeats} alternated repeats"
          + ("; 'off, auto': the default without speculation, not checked equal"
             if "off, auto" in arms else ""))
    print("| workload | concurrency | arm | output tok/s | vs off | acceptance length |")
    print("|---|---:|---|---:|---:|---:|")
    for r in results:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        print(f"| {r['workload']} | {r['concurrency']} | {r['arm']} | {r['output_tok_s']:.1f} | {r['ratio']:.2f}x | "
              f"{al} |")
    # What a verification costs: the runner's moving average of step time per bucket (T, S),
    # for the steps of at most 16 tokens (a decode of T requests, or verifications of T tokens).
    steps = {}
    for a, llm in engines.items():
        for (T, S), sec in sorted(llm.llm_engine.core.runner.step_seconds.items()):
            if T <= 16 and S == T:
                steps.setdefault(T, {})[a] = sec * 1e3
    print("\nstep time by bucket T = S (ms, moving average, every arm's steps of that shape)")
    print("| T | " + " | ".join(arms) + " |")
    print("|---:|" + "---:|" * len(arms))
    for T, by in sorted(steps.items()):
        print(f"| {T} | " + " | ".join(f"{by[a]:.1f}" if a in by else "-" for a in arms) + " |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"results": results, "step_ms": steps}, f, indent=2)
    return 0
