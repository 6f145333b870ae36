"""Draws throughput and p99 latency against concurrency, one line per mode or server, into a PNG."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_results"]


def plot_results(document: dict, path: str | Path) -> Path:
    """Write a two-panel PNG (output tok/s; p99 end-to-end and TTFT latency) for every target that ran."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = document["settings"]
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels_seen: set[int] = set()
    for target in document["targets"]:
        if target["status"] != "ok" or not target["levels"]:
            continue
        conc = [level["concurrency"] for level in target["levels"]]
        levels_seen.update(conc)
        tput = [level["output_throughput_tok_s"] for level in target["levels"]]
        e2e = [level["e2e_s"]["p99"] for level in target["levels"]]
        ttft = [level["ttft_s"]["p99"] for level in target["levels"]]
        (line,) = ax_tput.plot(conc, tput, marker="o", label=target["label"])
        ax_lat.plot(conc, [float("nan") if v is None else v for v in e2e], marker="o", color=line.get_color(),
                    label=f"{target['label']} E2E p99")
        ax_lat.plot(conc, [float("nan") if v is None else v for v in ttft], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{target['label']} TTFT p99")
    for ax in (ax_tput, ax_lat):
        if len(levels_seen) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels_seen))
        ax.set_xticklabels([str(c) for c in sorted(levels_seen)])
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    ax_tput.set_ylim(bottom=0)
    ax_lat.set_ylim(bottom=0)
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("throughput")
    ax_lat.set_ylabel("seconds")
    ax_lat.set_title("p99 latency")
    fig.suptitle(
        f"syshax benchmark: {settings['scenario']} ({settings['input_len']} in / {settings['output_len']} out),"
        f" {settings['iterations']} requests per level"
    )
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path
