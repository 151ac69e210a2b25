"""`bench memory --plot`: KV slots held and running sequences over time, one line per policy."""

from __future__ import annotations

from pathlib import Path


def plot_memory_report(report: dict, path: str | Path) -> Path:
    """Writes a two-panel PNG (KV slots held, running sequences; x: step) from run_memory_bench's report."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, (slots_ax, run_ax) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    capacity = report["budget"]["num_kv_blocks"] * report["budget"]["block_size"]
    for policy, series in report["series"].items():
        steps = range(len(series["slots"]))
        slots_ax.plot(steps, series["slots"], label=policy, linewidth=1.2)
        run_ax.plot(steps, series["running"], label=policy, linewidth=1.2)
    slots_ax.axhline(capacity, color="grey", linestyle=":", linewidth=1, label="KV capacity")
    slots_ax.set_ylabel("KV slots held")
    run_ax.set_ylabel("running sequences")
    run_ax.set_xlabel("step")
    slots_ax.legend(fontsize=8, loc="upper right")
    slots_ax.set_title(f"{report['requests']} requests ({report['sequences']} sequences), "
                       f"{report['budget']['num_kv_blocks']} blocks x "
                       f"{report['budget']['block_size']} tokens")  # fmt: skip
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
