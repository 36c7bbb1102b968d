"""``jaxllm bench serve --plot out.png``: latency distributions and output throughput over time."""

from __future__ import annotations

import numpy as np

from bench.metrics import MS, RequestOutput, tokens_over_time


def plot_serving(outputs: list[RequestOutput], path: str, title: str = "", percentiles: list[float] = (99.0,)) -> None:
    """Writes a PNG: histograms of TTFT, TPOT, ITL and E2EL (ms, with median and percentile lines)
    and the output tokens/s in 1-second buckets (the number of requests in flight beside it)."""
    import matplotlib
    matplotlib.use("Agg")  # no display here; never opens a window
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    series = {
        "TTFT": [o.ttft * MS for o in ok],
        "TPOT": [o.tpot * MS for o in ok if o.output_tokens > 1],
        "ITL": [g * MS for o in ok for g in o.itl],
        "E2EL": [o.latency * MS for o in ok],
    }
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    flat = axes.ravel()
    for ax, (name, vals) in zip(flat, series.items()):
        if vals:
            ax.hist(vals, bins=min(50, max(5, len(vals) // 2)), color="tab:blue", alpha=0.8)
            med = float(np.median(vals))
            ax.axvline(med, color="black", linestyle="--", label=f"median {med:.1f}")
            for p in percentiles:
                if p == 50:
                    continue  # the median line already
                v = float(np.percentile(vals, p))
                ax.axvline(v, color="tab:red", linestyle=":", label=f"P{p:g} {v:.1f}")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} (n={len(vals)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")

    ax = flat[4]
    t, tps = tokens_over_time(outputs)
    if t.size:
        edges = np.append(t, t[-1] + 1.0)  # draw the last bucket too
        ax.step(edges, np.append(tps, tps[-1]), where="post", color="tab:green", label="output tok/s")
        ax.set_ylabel("output tokens/s")
        ax2 = ax.twinx()
        t0 = min(o.start_time for o in ok)
        # Mean number of requests in flight over each bucket (their overlap with it, in bucket widths).
        in_flight = [sum(max(0.0, min(x + 1.0, o.start_time - t0 + o.latency) - max(x, o.start_time - t0))
                         for o in ok) for x in t]
        ax2.step(edges, in_flight + in_flight[-1:], where="post", color="tab:orange", alpha=0.7,
                 label="requests in flight (mean)")
        ax2.set_ylabel("requests in flight")
        ax2.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Output throughput over time (1 s buckets)")
    ax.set_xlabel("s since the first request")

    ax = flat[5]
    if ok:
        ax.scatter([o.ttft * MS for o in ok], [o.latency * MS for o in ok], s=10, color="tab:purple")
    ax.set_title("TTFT vs E2EL per request")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("E2EL (ms)")

    fig.suptitle(title or "jaxllm bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
