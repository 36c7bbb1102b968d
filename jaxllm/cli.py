"""The ``jaxllm`` command line: ``generate``, ``chat`` (and ``serve`` / ``bench`` where installed).

Flags follow vLLM's names.  A user error (bad flag value, missing checkpoint, prompt too
long) prints one line naming the problem and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import logging
import os
import sys

from jaxllm.config import (KV_CACHE_DTYPES, LOGPROBS_MODES, PRECOMPILE_MODES, QUANTIZATION_METHODS, SCHEDULING_POLICIES,
                           EngineConfig, parse_size, SchedulerConfig)
from jaxllm.errors import JaxllmError
from jaxllm.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    model = p.add_argument_group('model')
    mem = p.add_argument_group('memory and batching (sizes: 1073741824, 512MiB, 1GB)')
    kern = p.add_argument_group('kernels')
    comp = p.add_argument_group('compilation')
    out = p.add_argument_group('requests and outputs')
    if model_positional:
        model.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="HF folder, .gguf file or Hub repo id (org/name, org/name:Q4_K_M for one GGUF) "
                            "(default: the built-in SmolLM2-135M-Instruct)")
    model.add_argument("--model", default=None, help="HF folder, .gguf file or Hub repo id (org/name, "
                                                     "org/name:Q4_K_M) (default: built-in SmolLM2-135M-Instruct)")
    model.add_argument("--revision", default=None,
                       help="branch, tag or commit of a Hub model id (default: main)")
    model.add_argument("--download-dir", default=None,
                       help="where a Hub model id is downloaded (default: the Hugging Face cache, $HF_HOME/hub); "
                            "HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE=1 (cache only) are read from the environment")
    model.add_argument("--gguf-file", default=None, metavar="NAME",
                       help="the .gguf file of a Hub repo to serve (or tag the model id: org/name:Q4_K_M)")
    model.add_argument("--tokenizer", default=None,
                       help="tokenizer folder, .gguf file or Hub repo id, when it differs from the model's")
    model.add_argument("--tokenizer-revision", default=None,
                       help="branch, tag or commit of a Hub tokenizer id (default: --revision)")
    model.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 | float16: the activations and the KV cache (and the weights "
                        "of an unquantized checkpoint); auto: float32 on CPU")
    model.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="how the weights are quantized (default: what the checkpoint says: a quantized GGUF is "
                        "served as its blocks, gguf; an HF folder by its config.json quantization_config: "
                        "compressed-tensors, gptq or fp8, which a flag must match); int8 / fp8 on a float HF "
                        "checkpoint: quantize its linear layers at load (per-channel int8 / e4m3)")
    model.add_argument("--dequantize", action="store_true",
                   help="load a quantized GGUF as float weights instead of keeping its blocks")
    mem.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    mem.add_argument("--max-num-seqs", type=int, default=None, help="most requests per step (CPU default 32)")
    mem.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step, prefill chunks and decodes together (CPU default 512)")
    mem.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    mem.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory_bytes", default=None,
                   help="budget for the whole KV cache across all layers, e.g. 1073741824 or 1GiB")
    mem.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV blocks")
    mem.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the memory left after weights and activations (CPU: of the memory "
                        "available to the process) for the KV cache, when --kv-cache-memory-bytes is not given")
    mem.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model dtype), int8 (per-token, per-head scales), "
                        "fp8 (= fp8_e4m3) or fp8_e5m2: the same memory holds ~2-4x the tokens")
    mem.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default on; --no-enable-prefix-caching turns it off)")
    mem.add_argument("--mm-encoder-cache-tokens", type=int, default=None,
                   help="a vision-language model's encoder cache budget in image tokens, least recently used "
                        "image evicted first (default: 64 images' tokens; 0: no cache)")
    mem.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help="the image processor's arguments over preprocessor_config.json, vLLM's JSON: Qwen3.5's "
                        "min_pixels / max_pixels, e.g. '{\"max_pixels\": 4194304}' (also the encoder's largest "
                        "compiled patch bucket; default: the checkpoint's, capped at 4096 patches)")
    mem.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs (arrival order), priority (lowest request priority first) or lpm "
                        "(longest cached prefix first)")
    mem.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=SchedulerConfig.async_scheduling,
                   help="schedule and prepare the next step while the current one runs, its sampled tokens "
                        "fed to the next on the device (default on; speculative decoding and multi-host run "
                        "synchronously; --no-async-scheduling: one step at a time)")
    out.add_argument("--seed", type=int, default=0, help="seed for the seeds of unseeded requests")
    kern.add_argument("--attention-backend", default="auto",
                   help="auto | xla | pallas | native: paged attention (auto: the Pallas kernel on GPU; on CPU "
                        "the native AVX2 kernel when it builds, on one device with unrolled layers; else XLA)")
    kern.add_argument("--sampler-backend", default="auto",
                   help="auto | xla | pallas: the sampler's vocabulary reduction (auto: Pallas on GPU)")
    comp.add_argument("--scan-layers", dest="scan_layers", action="store_true", default=None,
                   help="run layers under lax.scan (default on accelerators)")
    comp.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                   help="unroll the layers (default on CPU: faster decode, slower compile)")
    out.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a request may ask for")
    kern.add_argument("--cpu-matmul", default="auto",
                   help="auto | native | native-int8 | native-int8-split | native-int16 | xla: the native AVX2 matmul kernels or XLA's dot on CPU; "
                        "native-int8 multiplies a GGUF's Q8_0/Q4_*/Q5_* blocks by activations rounded to int8 "
                        "per 32 values (llama.cpp's and vLLM's GGUF arithmetic: faster; on the built-in model its logits "
                        "move by up to ~3 of 31 and greedy text parts from float32's after 3-30 tokens); "
                        "native-int8-split: the int8 kernel twice, on the rounded activations and on the remainder "
                        "(close to float32's products at twice int8's cost); "
                        "native-int16: Q4_1 blocks, and on AVX-512 VNNI Q8_0 ones too, by activations rounded to "
                        "int16 per 32 values (the other types as native; float32's perplexity, faster where the "
                        "CPU lacks AVX-512 or lacks AMX); "
                        "auto: native-int16 where the CPU lacks AVX-512 or has AVX-512 VNNI without AMX, "
                        "else native (float32 activations; "
                        "int8's perplexity is over 1%% worse: docs/BENCHMARKS.md)")
    comp.add_argument("--compile-cache-dir", default=None,
                   help="persistent XLA cache and saved programs (default $JAXLLM_CACHE_DIR/xla, "
                        "~/.cache/jaxllm/xla)")
    comp.add_argument("--precompile", default="auto", choices=PRECOMPILE_MODES,
                   help="compile every step bucket before the first step (all), or each when first "
                        "needed (on-demand); auto: all for serve, on demand for generate and chat")
    out.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what logprobs report: the raw model output (default) or the processed one, as logprobs or logits")
    out.add_argument("--use-fp64-gumbel", action="store_true",
                   help="draw with float64 Gumbel noise (53-bit uniforms) instead of float32")
    out.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='structured outputs, vLLM\'s shape: '
                        '{"backend": "auto"|"guidance", '
                        '"disable_any_whitespace": true (compact JSON; false: any whitespace), '
                        '"disable_additional_properties": false, '
                        '"enable_in_reasoning": false, "reasoning_end_token_ids": [], "cache_size": 256}')
    out.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s shape: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", '
                        '"model": PATH or Hub id, "num_speculative_tokens": 4}; outputs are the same tokens as without it')
    g = p.add_argument_group("parallelism (docs/scale-out.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices one model replica is split over (heads, MLP width, vocabulary)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind one server; requests go to the least-loaded one")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: spread the experts over the tensor-parallel devices")
    g.add_argument("--distributed-coordinator", default=None,
                   help="host:port of host 0's JAX coordination service (multi-host)")
    g.add_argument("--num-hosts", type=int, default=1, help="processes (hosts) running one engine together")
    g.add_argument("--host-index", type=int, default=None,
                   help="this host's index; host 0 schedules and serves, the others follow its steps")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = getattr(args, "model_pos", None) or args.model
    kv_bytes = None if args.kv_cache_memory_bytes is None else parse_size(
        args.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
    return EngineConfig.from_kwargs(
        model=model, revision=args.revision, download_dir=args.download_dir, gguf_file=args.gguf_file,
        tokenizer=args.tokenizer, tokenizer_revision=args.tokenizer_revision, seed=args.seed, dtype=args.dtype,
        quantization=args.quantization, dequantize=args.dequantize,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=kv_bytes, num_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype, mm_encoder_cache_tokens=args.mm_encoder_cache_tokens,
        scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend,
        sampler_backend=args.sampler_backend, scan_layers=args.scan_layers,
        max_logprobs=args.max_logprobs, cpu_matmul=args.cpu_matmul, compile_cache_dir=args.compile_cache_dir,
        logprobs_mode=args.logprobs_mode, use_fp64_gumbel=args.use_fp64_gumbel, precompile=args.precompile,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, distributed_coordinator=args.distributed_coordinator,
        num_hosts=args.num_hosts, host_index=args.host_index,
        structured_outputs_config=args.structured_outputs_config, mm_processor_kwargs=args.mm_processor_kwargs,
        speculative_config=args.speculative_config)


def simulate_cpu_devices(args: argparse.Namespace) -> None:
    """On a CPU-only machine, ``-tp``/``-dp`` > 1 need that many XLA host devices, which must
    be requested before JAX starts its backend.  Harmless on accelerators (the flag only
    shapes the host platform) and a no-op when the user already set it."""
    per_host = getattr(args, "tensor_parallel_size", 1) * getattr(args, "data_parallel_size", 1)
    per_host = -(-per_host // max(1, getattr(args, "num_hosts", 1) or 1))
    flags = os.environ.get("XLA_FLAGS", "")
    if per_host > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per_host}".strip()


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the draw")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from_args(args):
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop)


def cmd_generate(args) -> int:
    sp = sampling_params_from_args(args)  # validate before the (slow) engine start
    prompts = args.prompt or _prompt_from_stdin()
    engine_config_from_args(args)          # the flags' values too
    llm = _make_llm(args)
    if llm.llm_engine.core.is_follower:
        llm.follow()   # multi-host: host 0 prints the results
        return 0
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    for o in outs:
        print(o.outputs[0].text if args.chat else (o.prompt or "") + o.outputs[0].text)
        if len(outs) > 1:
            print("-" * 40)
    sys.stdout.flush()   # the text is out now, not when the process has torn JAX down
    return 0


def _prompt_from_stdin() -> list[str]:
    """The prompt piped on stdin, read before the model loads; none (a terminal, or nothing
    piped) is refused now rather than after the start-up."""
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no prompt: give one as an argument (jaxllm generate \"Hello\") or pipe it on stdin")
    text = sys.stdin.read()
    if not text.strip():
        raise ValueError("no prompt: stdin was empty; give one as an argument (jaxllm generate \"Hello\")")
    return [text]


def cmd_chat(args) -> int:
    # The engine is imported by the command that runs it (see _make_llm).
    from jaxllm.engine.output_processor import OutputKind
    from jaxllm.engine.render import render_chat_prompt
    sp = sampling_params_from_args(args)
    llm = _make_llm(args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    ids = itertools.count()
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        rid = f"chat-{next(ids)}"
        engine.add_request(rid, render_chat_prompt(tok, messages).engine_prompt(), sp, kind=OutputKind.DELTA)
        reply = []
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    piece = out.outputs[0].text
                    reply.append(piece)
                    print(piece, end="", flush=True)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _make_llm(args):
    # Imported when a command starts an engine, not with the parser: `jaxllm --help` and a flag
    # error answer without importing JAX and the engine (~60 ms instead of ~4 s), and
    # simulate_cpu_devices sets XLA_FLAGS before any of it loads.
    from jaxllm.llm import LLM
    return LLM.from_engine_config(engine_config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="LLM inference compiled by XLA")
    parser.add_argument("--log-level", default=os.environ.get("JAXLLM_LOG_LEVEL") or None,
                        help="level of every logger (default: INFO for jaxllm's start-up lines, WARNING "
                             "for the libraries'); also $JAXLLM_LOG_LEVEL")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts and print the results")
    g.add_argument("prompt", nargs="*", help="prompts (default: read one from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_engine_args(g)
    add_sampling_args(g, max_tokens=64)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    for name, module in (("serve", "serve.cli"), ("bench", "bench.cli")):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name in (module, module.split(".")[0]):
                continue  # that part is not installed; a broken import inside it still raises
            raise
        mod.register(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:   # argparse keeps its subparsers there and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def _unknown_flags_message(sub: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized argument --x; did you mean --y?`` for the first unknown argument."""
    flag = extras[0].split("=", 1)[0]
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("-") else []
    more = f" (and {len(extras) - 1} more: {' '.join(extras[1:])})" if len(extras) > 1 else ""
    hint = f"; did you mean {close[0]}?" if close else f"; {sub.prog} --help lists them"
    return f"unrecognized argument {flag}{hint}{more}"


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown argument is reported by its subcommand (its
    usage, not the top-level one) with the closest flag it knows; exit status 2."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = _subparser(parser, args.command)
        sub.error(_unknown_flags_message(sub, extras))
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    logging.basicConfig(level=(args.log_level or "WARNING").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    if args.log_level is None:
        # What the start-up does (weights, tokenizer, kernels, KV cache, compiling) is worth
        # seeing by default: it takes seconds to minutes.  Libraries stay at WARNING.
        for name in ("jaxllm", "serve"):
            logging.getLogger(name).setLevel(logging.INFO)
    simulate_cpu_devices(args)
    try:
        return args.func(args) or 0
    except (JaxllmError, ValueError) as e:
        logging.getLogger("jaxllm").debug("user error", exc_info=True)
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        # A runtime dependency missing from a broken install (the engine's modules import
        # theirs at the top): name the package and how to install it, in one line.
        package = (e.name or "").split(".")[0]
        if not package or package == "jaxllm":
            raise
        print(f"jaxllm {args.command}: error: the Python package {package!r} is missing or cannot be "
              f"imported ({e}); install it with `pip install {package}`", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
