"""``jaxllm bench ...``: the subcommands live in their own modules, each with ``register``."""

from __future__ import annotations


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="benchmarks: serve (HTTP client), throughput, latency, perplexity")
    sub = b.add_subparsers(dest="bench_command", required=True)
    from bench import offline, perplexity, serve_client, spec_decode, step_breakdown, structured
    serve_client.register(sub)
    offline.register(sub)
    structured.register(sub)
    perplexity.register(sub)
    spec_decode.register(sub)
    step_breakdown.register(sub)
