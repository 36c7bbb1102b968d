"""Speculative decoding's acceptance as a server reports it in ``/metrics`` (jaxllm's
``jaxllm:spec_decode_*`` counters, or vLLM's ``vllm:spec_decode_*``): read before and after a
benchmark run, the difference is the run's.  A server without those counters (or without
``/metrics``) reports nothing, and ``jaxllm bench serve`` prints no section for it."""

from __future__ import annotations

from dataclasses import dataclass

_NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(frozen=True)
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    per_pos: tuple[float, ...] = ()

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        pos = [v - (before.per_pos[i] if i < len(before.per_pos) else 0.0) for i, v in enumerate(self.per_pos)]
        return SpecCounters(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens, tuple(pos))


def parse(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition, summed over engines; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    found = False
    for fam in text_string_to_metric_families(text):
        for prefix in ("jaxllm:spec_decode_", "vllm:spec_decode_"):
            if not fam.name.startswith(prefix):
                continue
            name = fam.name[len(prefix):]
            for s in fam.samples:
                if not s.name.endswith("_total"):
                    continue
                found = True
                if name == "num_accepted_tokens_per_pos":
                    p = int(s.labels.get("position", 0))
                    per_pos[p] = per_pos.get(p, 0.0) + s.value
                elif name in _NAMES:
                    totals[name] = totals.get(name, 0.0) + s.value
    if not found:
        return None
    return SpecCounters(*(totals.get(n, 0.0) for n in _NAMES),
                        tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ())


async def fetch(base_url: str, headers: dict | None, verify: bool) -> SpecCounters | None:
    import httpx
    try:
        async with httpx.AsyncClient(timeout=30, verify=verify) as client:
            r = await client.get(f"{base_url}/metrics", headers=headers)
            if r.status_code != 200:
                return None
            return parse(r.text)
    except httpx.HTTPError:
        return None


def summary(run: SpecCounters) -> tuple[list[str], dict]:
    """vLLM's "Speculative Decoding" section and its result keys, for a run that verified proposals."""
    d = run.num_drafts
    rate = 100 * run.num_accepted_tokens / run.num_draft_tokens if run.num_draft_tokens else 0.0
    length = 1 + run.num_accepted_tokens / d
    per_pos = [100 * v / d for v in run.per_pos]
    lines = ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-")]
    for label, value in (("Acceptance rate (%):", f"{rate:.2f}"), ("Acceptance length:", f"{length:.2f}"),
                         ("Drafts:", f"{d:.0f}"), ("Draft tokens:", f"{run.num_draft_tokens:.0f}"),
                         ("Accepted tokens:", f"{run.num_accepted_tokens:.0f}")):
        lines.append(f"{label:<40} {value:<10}")
    lines.append(f"{'Per-position acceptance (%):':<40} " + ", ".join(f"{v:.2f}" for v in per_pos))
    keys = {"spec_decode_acceptance_rate": rate, "spec_decode_acceptance_length": length,
            "spec_decode_num_drafts": d, "spec_decode_draft_tokens": run.num_draft_tokens,
            "spec_decode_accepted_tokens": run.num_accepted_tokens, "spec_decode_per_position_acceptance_rates": per_pos}
    return lines, keys
