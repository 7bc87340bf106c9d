"""The report's figures (matplotlib, Agg): each function returns PNG bytes, or None when there is nothing to plot."""
from __future__ import annotations

import functools
import io

import numpy as np

from clusterscale.io.records import ShardManifest

PALETTE = {"clustered": "tab:red", "random": "tab:blue", "random_clusters": "tab:green", "curriculum": "tab:purple",
           "clustered+mined": "tab:orange", "random+mined": "tab:cyan"}


def available() -> bool:
    """Whether matplotlib is importable: a node without it (a bare GPU image) still gets report.md, without plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _optional(plot):
    """A plot that is None (nothing to plot) where matplotlib is not installed."""
    @functools.wraps(plot)
    def wrapped(*args, **kwargs):
        return plot(*args, **kwargs) if available() else None
    return wrapped


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


@_optional
def cluster_sizes(manifest: ShardManifest) -> bytes:
    """One bar per shard, largest first (a histogram of k values says little); log scale once sizes span 100x
    or k is large, so small shards stay visible next to the global-batch line."""
    plt = _pyplot()
    clusters = sorted(manifest.clusters, key=lambda c: -c.rows)
    rows = np.array([c.rows for c in clusters])
    fig, ax = plt.subplots(figsize=(max(6.0, min(12.0, 0.3 * len(rows))), 3.5))
    ax.bar(np.arange(len(rows)), rows, width=0.8 if len(rows) <= 200 else 1.0, color="tab:gray")
    ax.axhline(manifest.global_batch_size, color="tab:red", linestyle="--",
               label=f"one global batch ({manifest.global_batch_size})")
    if len(rows) <= 30:  # named ticks while they fit; rank on the axis beyond
        ax.set_xticks(np.arange(len(rows)), [str(c.name) for c in clusters], rotation=90 if len(rows) > 12 else 0)
        ax.set_xlabel("shard (largest first)")
    else:
        ax.set_xlabel("shard rank (largest first)")
    if len(rows) > 50 or rows.max() > 100 * max(1, rows.min()):
        ax.set_yscale("log")
    else:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # row counts: no fractional ticks
    ax.set_ylabel("rows")
    ax.set_title(f"Cluster sizes, k={manifest.k} ({len(rows)} shards)")
    ax.legend(fontsize=8)
    return _png(fig)


@_optional
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


@_optional
def cost_breakdown(rows: list[tuple[str, float, str]], summary: dict | None = None) -> bytes | None:
    """Left: worker-seconds per stage key, coloured by kind (preprocess|train|evaluate|other). Right, when the
    summary has a training epoch: preprocessing against one training epoch and the whole run (the key message)."""
    if not rows:
        return None
    plt = _pyplot()
    colors = {"preprocess": "tab:orange", "train": "tab:purple", "evaluate": "tab:cyan", "other": "tab:gray"}
    compared = bool(summary and summary.get("train_epoch_worker_s"))
    fig, axes = plt.subplots(1, 2 if compared else 1, figsize=(12 if compared else 7, 0.35 * len(rows) + 1.8),
                             squeeze=False, width_ratios=[3, 2] if compared else None)
    ax = axes[0][0]
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=[colors[r[2]] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("worker-seconds")
    kinds = [k for k in colors if any(r[2] == k for r in rows)]
    # Below the axes, so it never covers a bar.
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds], kinds, fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (len(rows) + 3)), ncol=len(kinds), frameon=False)
    ax.set_title("Cost per stage")
    if compared:
        ax = axes[0][1]
        labels = ["preprocessing", "training,\none epoch"]
        values = [summary["preprocess_worker_s"], summary["train_epoch_worker_s"]]
        if summary["epochs"] > 1:
            labels.append(f"training,\n{summary['epochs']} epochs")
            values.append(summary["train_total_worker_s"])
        bars = ax.bar(labels, values, color=[colors["preprocess"]] + [colors["train"]] * (len(values) - 1))
        ax.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=8)
        ax.set_ylabel("worker-seconds")
        ratio = summary.get("ratio_per_epoch")
        ax.set_title("Preprocessing vs training" + (f" (ratio {ratio:.2g} per epoch)" if ratio else ""))
    return _png(fig)


@_optional
def compare_arms(compare: dict, metric: str = "ndcg_at_10") -> bytes | None:
    """Every seed as a dot, the mean as a bar with ± std, on the metric's whole 0..1 axis (a cut axis makes a
    +0.01 difference look large); the mean and its spread are written above each arm."""
    arms = compare.get("arms", {})
    if not arms:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(arms) + 2), 4))
    names = list(arms)
    for i, name in enumerate(names):
        stats = arms[name]["metrics"][metric]
        ax.errorbar(i, stats["mean"], yerr=stats["std"], fmt="_", markersize=28, capsize=8, color="black", zorder=3)
        ax.scatter(i + np.linspace(-0.12, 0.12, len(stats["values"])), stats["values"], s=18, zorder=4,
                   color=PALETTE.get(name, "tab:gray"))
        ax.annotate(f"{stats['mean']:.3f} ± {stats['std']:.3f}\n(n={len(stats['values'])})", (i, 1.0),
                    xytext=(0, -4), textcoords="offset points", ha="center", va="top", fontsize=8)
    frozen = compare.get("frozen", {}).get(metric)
    if frozen is not None:
        ax.axhline(frozen, color="black", linestyle=":", label=f"frozen encoder ({frozen:.3f})")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xticks(range(len(names)), names)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title("Arms: dots = seeds, bar = mean ± std")
    return _png(fig)


@_optional
def paired_differences(compare: dict) -> bytes | None:
    """Per comparison (arm - baseline, same seeds): every seed's difference as a dot, the mean and its 95%
    interval as a bar, on an axis symmetric about 0 so that no difference looks like one."""
    paired = compare.get("paired") or {}
    if not paired:
        return None
    plt = _pyplot()
    metrics = [m for m in ("ndcg_at_10", "mrr_at_10") if all(m in d for d in paired.values())]
    fig, axes = plt.subplots(1, len(metrics), figsize=(max(4.5, 1.8 * len(paired) + 1.5) * len(metrics), 4),
                             squeeze=False)
    names = list(paired)
    for ax, metric in zip(axes[0], metrics):
        reach = 0.02
        for i, name in enumerate(names):
            d = paired[name][metric]
            low, high = d["ci95"] or (d["mean"], d["mean"])
            ax.errorbar(i, d["mean"], yerr=[[d["mean"] - low], [high - d["mean"]]], fmt="_", markersize=26,
                        capsize=8, color="black", zorder=3)
            ax.scatter(i + np.linspace(-0.1, 0.1, len(d["values"])), d["values"], s=18, zorder=4, color="tab:blue")
            reach = max(reach, *(abs(v) for v in d["values"]), abs(low), abs(high))
        ax.axhline(0.0, color="gray", linewidth=1)
        ax.set_ylim(-1.25 * reach, 1.25 * reach)
        ax.set_xticks(range(len(names)), [n.replace(" - ", "\n- ") for n in names], fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_ylabel(f"difference in held-out {metric}")
        ax.set_title("dots = seeds, bar = mean, 95% interval", fontsize=9)
    return _png(fig)


@_optional
def gain_against_cost(compare: dict, metric: str = "ndcg_at_10") -> bytes | None:
    """Per arm paired with random: the mean gain with its 95% interval (y) against the extra preprocessing
    worker-hours the arm needs (x), so that the quality an hour of preprocessing buys reads off the slope."""
    paired, arms = compare.get("paired") or {}, compare.get("arms", {})
    points = [(name, arm["preprocess"]["extra"]["worker_s"] / 3600, paired[f"{name} - random"][metric])
              for name, arm in arms.items() if "preprocess" in arm and f"{name} - random" in paired]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, hours, d) in enumerate(points):
        low, high = d["ci95"] or (d["mean"], d["mean"])
        ax.errorbar(hours, d["mean"], yerr=[[d["mean"] - low], [high - d["mean"]]], fmt="o", capsize=6,
                    color=PALETTE.get(name, f"C{i}"), label=name)
    ax.axhline(0.0, color="gray", linewidth=1)
    ax.set_xlabel("extra preprocessing over random (worker-hours)")
    ax.set_ylabel(f"{metric} - random (seed-paired mean, 95% interval)")
    ax.set_title("Gain over random against preprocessing cost", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


@_optional
def sweep_curves(sweep: dict) -> bytes | None:
    points = [p for p in sweep.get("points", []) if "error" not in p]
    if not points:
        return None
    plt = _pyplot()
    panels = [("Clustering cost", "seconds (fit + assign + shard)", lambda p: p["fit_s"] + p["assign_s"] + p["shard_s"]),
              ("Cluster tightness", "mean intra-cluster cosine", lambda p: p["mean_intra_cosine"]),
              ("Cluster balance", "largest / smallest shard (rows)", lambda p: p["max_rows"] / max(1, p["min_rows"]))]
    if any(p.get("ndcg_at_10") is not None for p in points):
        panels.append(("Held-out retrieval", "NDCG@10", lambda p: p.get("ndcg_at_10")))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8), squeeze=False)
    for ax, (title, ylabel, value) in zip(axes[0], panels):
        for i, limit in enumerate(sorted({p["rows"] for p in points})):
            sel = sorted((p for p in points if p["rows"] == limit), key=lambda p: p["k"])
            ys = [value(p) for p in sel]
            ax.plot([p["k"] for p in sel], [np.nan if y is None else y for y in ys], marker="o", color=f"C{i}",
                    label=f"N={limit}")
            frozen = [p["frozen_ndcg_at_10"] for p in sel if p.get("frozen_ndcg_at_10") is not None]
            if ylabel == "NDCG@10" and frozen:  # the untrained encoder: the bar a trained model must clear
                ax.axhline(frozen[0], color=f"C{i}", linestyle=":", label=f"frozen, N={limit}")
        ax.set_xscale("log")
        ks = sorted({p["k"] for p in points})
        ax.set_xticks(ks, [str(k) for k in ks])  # the swept values, not 10^x ticks
        ax.minorticks_off()
        ax.set_xlabel("k")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()  # room for every panel's y label
    return _png(fig)
