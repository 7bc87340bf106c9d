"""The report's figures (matplotlib, Agg): each function returns PNG bytes, or None when there is nothing to plot."""
from __future__ import annotations

import io

import numpy as np

PALETTE = {"clustered": "tab:red", "random": "tab:blue", "random_clusters": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes and CI
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over `window` steps (shorter at the start), same length as `values`."""
    cumsum = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (cumsum[idx] - cumsum[lo]) / (idx - lo)


def cluster_sizes(manifest: dict) -> bytes:
    plt = _pyplot()
    rows = np.array([c["rows"] for c in manifest["clusters"]])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(rows, bins=min(30, max(5, len(rows))), color="tab:gray", edgecolor="black")
    ax.axvline(manifest["global_batch_size"], color="tab:red", linestyle="--", label="one global batch")
    ax.set_xlabel("rows per shard")
    ax.set_ylabel("shards")
    ax.set_title(f"Cluster sizes, k={manifest['k']} ({len(rows)} shards)")
    ax.legend()
    return _png(fig)


def training_curves(curves: dict[str, dict[str, list[dict]]], keys: tuple[str, ...], ylabels: tuple[str, ...],
                    title: str) -> bytes | None:
    """One panel per metric key; per sampler group the seeds faintly and their mean's rolling average bold.

    curves: {group (sampler): {run name: [metrics.jsonl records]}} (the paper's Figure 2 for key 'loss')."""
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4), squeeze=False)
    for ax, key, ylabel in zip(axes[0], keys, ylabels):
        for i, (group, runs) in enumerate(sorted(curves.items())):
            color = PALETTE.get(group, f"C{i % 10}")  # one color per group for its seeds and its mean
            series = [np.array([r[key] for r in recs], dtype=float) for recs in runs.values()]
            for s in series:
                ax.plot(s, color=color, alpha=0.25, linewidth=0.8)
            length = min(len(s) for s in series)
            mean = np.mean([s[:length] for s in series], axis=0)
            window = max(1, length // 10)
            ax.plot(rolling_mean(mean, window), color=color, linewidth=2,
                    label=f"{group} (n={len(series)}, rolling {window})")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _png(fig)


def cost_breakdown(rows: list[tuple[str, float, str]]) -> bytes | None:
    """rows: (stage key, worker-seconds, kind: preprocess|train|evaluate|other)."""
    if not rows:
        return None
    plt = _pyplot()
    colors = {"preprocess": "tab:orange", "train": "tab:purple", "evaluate": "tab:cyan", "other": "tab:gray"}
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    names = [r[0] for r in rows]
    ax.barh(names, [r[1] for r in rows], color=[colors[r[2]] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("worker-seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=8, loc="lower right")
    ax.set_title("Cost per stage")
    return _png(fig)


def compare_arms(compare: dict, metric: str = "ndcg_at_10") -> bytes | None:
    arms = compare.get("arms", {})
    if not arms:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(arms)
    for i, name in enumerate(names):
        stats = arms[name]["metrics"][metric]
        ax.bar(i, stats["mean"], yerr=stats["std"], color=PALETTE.get(name, "tab:gray"), alpha=0.6, capsize=6)
        ax.scatter([i] * len(stats["values"]), stats["values"], color="black", zorder=3, s=12)
    frozen = compare.get("frozen", {}).get(metric)
    if frozen is not None:
        ax.axhline(frozen, color="black", linestyle=":", label="frozen encoder")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names)
    values = [v for a in arms.values() for v in a["metrics"][metric]["values"]] + ([frozen] if frozen else [])
    span = max(values) - min(values)
    ax.set_ylim(max(0.0, min(values) - span - 0.01), min(1.0, max(values) + span + 0.01))
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title("Arms: mean ± std over seeds (dots: seeds)")
    return _png(fig)


def sweep_curves(sweep: dict) -> bytes | None:
    points = [p for p in sweep.get("points", []) if "error" not in p]
    if not points:
        return None
    plt = _pyplot()
    panels = [("stage seconds (fit+assign+shard)", lambda p: p["fit_s"] + p["assign_s"] + p["shard_s"]),
              ("mean intra-cluster cosine", lambda p: p["mean_intra_cosine"]),
              ("shard size max/min", lambda p: p["max_rows"] / max(1, p["min_rows"]))]
    if any(p.get("ndcg_at_10") is not None for p in points):
        panels.append(("held-out NDCG@10", lambda p: p.get("ndcg_at_10")))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (label, value) in zip(axes[0], panels):
        for limit in sorted({p["rows"] for p in points}):
            sel = sorted((p for p in points if p["rows"] == limit), key=lambda p: p["k"])
            ys = [value(p) for p in sel]
            ax.plot([p["k"] for p in sel], [np.nan if y is None else y for y in ys], marker="o", label=f"N={limit}")
        ax.set_xscale("log")
        ks = sorted({p["k"] for p in points})
        ax.set_xticks(ks, [str(k) for k in ks])  # the swept values, not 10^x ticks
        ax.minorticks_off()
        ax.set_xlabel("k")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    return _png(fig)
