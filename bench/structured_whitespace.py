"""How often sampled JSON-schema outputs complete within ``max_tokens``, with the grammars'
flexible whitespace and with compact whitespace (vLLM's ``disable_any_whitespace``).

Flexible: llguidance lets the model put any run of whitespace between JSON tokens; a small
model sampled at temperature 1 can spend its tokens on newlines and spaces (or loop on them)
and run out before the object closes.  Compact: no whitespace between tokens at all.
Offline, on the built-in model (or ``--model``); prints one table (completed: finish reason
``stop`` and the text parses as JSON).  docs/BENCHMARKS.md ("Structured outputs: whitespace")
has the numbers and the default they chose.

    python bench/structured_whitespace.py                    # 10 schemas x 4 seeds x 2 temperatures
    python bench/structured_whitespace.py --seeds 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams

# (what to describe, schema): small objects a 135M model can fill in.
SCHEMAS = [
    ("Paris", {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                                "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
               "required": ["name", "country", "population"]}),
    ("a book you like", {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                                          "year": {"type": "integer", "minimum": 0, "maximum": 2100}},
                         "required": ["title", "author", "year"]}),
    ("a person", {"type": "object", "properties": {"first_name": {"type": "string"}, "last_name": {"type": "string"},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["first_name", "last_name", "age"]}),
    ("today's weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                          "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                                          "celsius": {"type": "integer", "minimum": -50, "maximum": 50}},
                         "required": ["city", "sky", "celsius"]}),
    ("three colors", {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                                                                  "minItems": 3, "maxItems": 3}},
                      "required": ["colors"]}),
    ("a product", {"type": "object", "properties": {"name": {"type": "string"}, "in_stock": {"type": "boolean"},
                                                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
                   "required": ["name", "in_stock", "tags"]}),
    ("a point on a map", {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                           "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                          "required": ["lat", "lon"]}),
    ("a song", {"type": "object", "properties": {"title": {"type": "string"}, "artist": {"type": "string"},
                                                 "genre": {"enum": ["pop", "rock", "jazz", "classical"]}},
                "required": ["title", "artist", "genre"]}),
    ("an address", {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]}),
    ("a tool call to get the weather in Paris", {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "required": ["name", "arguments"]}),
]
MODES = {"flexible": False, "compact": True}   # mode -> disable_any_whitespace


def completed(out) -> bool:
    if out.finish_reason != "stop":
        return False
    try:
        json.loads(out.text)
    except ValueError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--seeds", type=int, default=4, help="seeds per schema and temperature")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]

    # Flexible engine-wide (compact is the default); each compact request says so itself.
    llm = LLM(args.model, max_model_len=512, max_num_seqs=args.max_num_seqs,
              structured_outputs_config={"disable_any_whitespace": False})
    convs, params, keys = [], [], []
    for mode, compact in MODES.items():
        for t in temps:
            for what, schema in SCHEMAS:
                for seed in range(args.seeds):
                    convs.append([{"role": "user", "content": f"Describe {what} as JSON."}])
                    params.append(SamplingParams(
                        temperature=t, seed=seed, max_tokens=args.max_tokens,
                        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=compact)))
                    keys.append((mode, t))
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start

    counts: dict = {}
    for key, out in zip(keys, outs):
        o = out.outputs[0]
        ok, n, tokens = counts.get(key, (0, 0, 0))
        counts[key] = (ok + completed(o), n + 1, tokens + len(o.token_ids))
    print(f"{len(SCHEMAS)} schemas x {args.seeds} seeds, max_tokens {args.max_tokens}, "
          f"{len(outs)} requests in {elapsed:.0f} s")
    print("| whitespace | temperature | completed | mean output tokens |")
    print("|---|---|---|---|")
    for (mode, t), (ok, n, tokens) in sorted(counts.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        print(f"| {mode} | {t:g} | {ok}/{n} ({100 * ok / n:.0f}%) | {tokens / n:.1f} |")


if __name__ == "__main__":
    main()
