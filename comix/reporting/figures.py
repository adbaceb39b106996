"""The figures of a comparison grid, written beside compare.md and drawn on the report's page:
learning curves (CoMiGS Fig. 9), utility against epsilon, FedAMoLE's expert assignment (Fig. 8)
and DeepFusion's global model against its baselines."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..comparison import MANY_USERS, _device_memory, _global_scored, _jsonl, metric_of, metric_title
from ..specs import spec_dirname


def plot_curves(data: dict, path: Path, per_user: bool, refs: dict | None = None,
                ylabel: str = "test perplexity") -> bool:
    """Learning curves, mean over users or a panel per user (each method the report's colour);
    when only one iteration was evaluated, a bar per method instead of lone dots; False (nothing
    drawn) when there is no curve, or a panel per user is asked for more than MANY_USERS users
    (1000 panels would not read, nor fit Agg's 65,536-pixel limit)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from ..comparison import short_spec
    from ..files import atomic_write
    from .page import method_styles

    styles = method_styles([*data, *(refs or {})])  # the report's colour of each method
    users = sorted({u for by_user in data.values() for u in by_user})
    if not users or (per_user and len(users) > MANY_USERS):  # untrained methods only (Pretrained): no curve
        return False
    panels = users if per_user else ["mean over users"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    single = len({it for by_user in data.values() for u in by_user.values() for it, _ in u}) == 1
    for ax, panel in zip(axes[0], panels):
        names, values = [], []
        for i, (spec, by_user) in enumerate(data.items()):
            if per_user:
                pts = by_user.get(panel, [])
            else:
                its = sorted({it for u in by_user.values() for it, _ in u})
                pts = [(it, statistics.fmean(v for u in by_user.values() for i, v in u if i == it)) for it in its]
            if pts and not single:
                ax.plot(*zip(*pts), ms=3, label=short_spec(spec), **styles[spec].line())
            names.append(spec)
            values.append(pts[-1][1] if pts else float("nan"))
        if single:  # the score of the one evaluated iteration (the last), a bar per method
            for k, spec in enumerate(names):
                ax.bar_label(ax.bar([k], [values[k]], **styles[spec].bar()), fmt="%.4g", fontsize=7)
            ax.set_xticks(range(len(names)), [short_spec(n) for n in names], rotation=30, ha="right", fontsize=7)
        for spec, by_user in (refs or {}).items():
            level = by_user.get(panel) if per_user else statistics.fmean(by_user.values())
            if level is not None:
                ax.axhline(level, ls="--", lw=1, color="grey", label=short_spec(spec))
        ax.set_title(panel)
        if not single:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
            ax.set_xlabel("iteration")
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.set_ylabel(ylabel)
    if not single or refs:
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot, over no data
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
    return True


def privacy_figure(results: dict[str, dict[int, dict]], styles: dict | None = None):
    """The task metric against epsilon, one line per method over its noise levels with the
    population std over seeds as error bars (noise-free runs drawn as a dashed reference), each
    epsilon a labelled tick with its noise multiplier sigma under it (a log axis within one decade
    has no labelled tick of its own); methods at the same epsilon drawn side by side, not on top
    of each other; each method in its page colour (``styles``: page.method_styles), the legend
    beside the plot. None when no run added noise."""
    from .page import method_styles
    styles = styles or method_styles(results)
    points: dict[str, list[tuple[float, float, float]]] = {}
    free: dict[str, float] = {}
    sigmas: dict[float, set] = {}
    colour: dict[str, str] = {}
    for spec, by_seed in results.items():
        values = [metric_of(r)[1] for r in by_seed.values()]
        mean = statistics.fmean(values)
        method = spec.split(":")[0]
        first = next(iter(by_seed.values()))
        eps = first.get("epsilon")
        if eps is None:
            free[method] = mean
            colour[method] = styles[spec].color if spec in styles else colour.get(method)
        else:
            points.setdefault(method, []).append((eps, mean, statistics.pstdev(values)))
            sigmas.setdefault(float(f"{eps:.3g}"), set()).add((first.get("privacy") or {}).get("noise_multiplier"))
            colour.setdefault(method, styles[spec].color if spec in styles else None)
    if not points:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.8))
    methods = sorted(points)
    for i, method in enumerate(methods):
        pts = sorted(points[method])
        dodge = 1.02 ** (i - (len(methods) - 1) / 2)  # x factor on the log axis: equal epsilons side by side
        bars = ax.errorbar([e * dodge for e, _, _ in pts], [v for _, v, _ in pts], yerr=[s for _, _, s in pts], fmt="o-",
                           capsize=3, color=colour.get(method), label=method + (" (one noise level)" if len(pts) == 1 else ""))
        if method in free:
            ax.axhline(free[method], ls="--", color=bars.lines[0].get_color(), lw=1, label=f"{method}, no DP")
    ax.set_xscale("log")
    from matplotlib.ticker import FixedLocator, NullLocator
    ticks = sorted(sigmas)
    ax.xaxis.set_major_locator(FixedLocator(ticks))  # each epsilon run, labelled as it reads
    ax.xaxis.set_minor_locator(NullLocator())
    known = {e: sorted(x for x in sigmas[e] if x is not None) for e in ticks}
    ax.set_xticks(ticks, [f"{e:g}" + ("\nsigma " + "/".join(f"{x:g}" for x in known[e]) if known[e] else "") for e in ticks])
    if len(ticks) == 1:  # one epsilon: room either side for the side-by-side points
        ax.set_xlim(ticks[0] / 1.3, ticks[0] * 1.3)
    ax.set_xlabel("epsilon after the last round (log), its noise multiplier sigma below")
    ax.set_ylabel(metric_title([r for by in results.values() for r in by.values()]))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot, over no point
    fig.tight_layout()
    return fig


def plot_privacy(results: dict[str, dict[int, dict]], path: Path) -> bool:
    """``privacy_figure`` written to ``path``; False when there is none."""
    fig = privacy_figure(results)
    if fig is None:
        return False
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_assignment(run_dir: Path, spec: str, seed: int, path: Path) -> bool:
    """FedAMoLE Fig. 8 from a run's server.jsonl: per round (first and last) the relevance of
    clients to domain experts in one AMoLE module (the server's matrix s of eq. 26, drawn as the
    selection probabilities the MILP maximises; the paper's t-SNE of per-example relevance would
    need per-example uploads, which FedAMoLE does not send) and the number of experts each
    client is assigned for the next round in that module. False (nothing drawn) when the run
    logged no relevance (not FedAMoLE with RSEA)."""
    rows = [r for r in _jsonl(run_dir / f"seed{seed}" / spec_dirname(spec) / "server.jsonl") if "relevance" in r]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from ..files import atomic_write

    shown = [rows[0], rows[-1]] if len(rows) > 1 else rows
    fig, axes = plt.subplots(len(shown), 2, figsize=(11, 3.4 * len(shown)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (heat, bars), row in zip(axes, shown):
        module = row["relevance"]["module"]
        # each expert's preference over clients, P = softmax over clients of s (eq. 28): the
        # column-wise softmax removes what differs between experts only (their embedding norms)
        probs = torch.softmax(torch.tensor(row["relevance"]["s"], dtype=torch.float64), dim=0)
        # drawn as the distance from uniform (1 / N), which is what the MILP's choice rests on; the
        # colour bar in plain numbers with the scale in its label (no offset notation)
        dev = probs - 1 / probs.shape[0]
        scale = 10 ** math.floor(math.log10(float(dev.abs().max()) or 1.0))
        im = heat.imshow((dev / scale).numpy(), aspect="auto", cmap="coolwarm")
        bar = fig.colorbar(im, ax=heat, fraction=0.03)
        bar.formatter.set_useOffset(False)
        bar.set_label(f"P - 1/N (x {scale:.0e})", fontsize=7)
        heat.set_title(f"round {row['round']}: selection probability P = softmax over clients of relevance, "
                       f"{module}; max |P - 1/N| = {float(dev.abs().max()):.1e}", fontsize=8)
        heat.set_xlabel("domain expert (global id)")
        heat.set_ylabel("client")
        counts = row["experts_per_client"][module]
        for ax in (heat, bars):
            ax.set_yticks(range(len(counts)))
        bars.barh(range(len(counts)), counts)
        bars.set_ylim(len(counts) - 0.5, -0.5)
        bars.set_title("experts assigned next round", fontsize=8)
        bars.set_xlabel("experts")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
    return True


def plot_global_model(run_dir: Path, results: dict[str, dict[int, dict]], seeds: list[int], path: Path) -> bool:
    """DeepFusion Fig. 7-9 in one figure: (a) the global model's test token perplexity (log, mean
    over domains and seeds) per method, the dense base before distillation dashed (Fig. 9 when
    central-moe ran: the centralized bound is one of the bars); (b) total upload per method (MB,
    log scale; Fig. 8); (c) training state of each device model (MB; Fig. 7). False (nothing
    drawn) when no method scored a global model."""
    scored = _global_scored(results)
    if not scored:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..files import atomic_write

    def mean_over(by, key):
        return statistics.fmean(statistics.fmean(v[key] for v in r["per_user"].values()) for r in by.values())

    specs = list(scored)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    log_ppl = [mean_over(scored[s], "test_log_ppl") for s in specs]
    base = mean_over(next(iter(scored.values())), "test_base_log_ppl")
    ax.bar_label(ax.bar(range(len(specs)), log_ppl, color="tab:blue"), fmt="%.3f", fontsize=7)
    ax.axhline(base, ls="--", color="grey", label=f"dense base before distillation ({base:.3f})")
    ax.set_ylim(0.9 * min(log_ppl + [base]), 1.05 * max(log_ppl + [base]))  # the differences, not the zero
    ax.set_title("(a) global model: test token perplexity (log)")
    ax.legend(fontsize=7)
    ax = axes[1]
    upload = [statistics.fmean(r["bytes_up_total"] / 2**20 for r in scored[s].values()) for s in specs]
    ax.bar_label(ax.bar(range(len(specs)), [u or float("nan") for u in upload], color="tab:orange"),  # 0: no bar
                 labels=[f"{u:,.0f}" for u in upload], fontsize=7)
    if any(upload):  # central-moe alone uploads nothing: no bar for a log scale to place
        ax.set_yscale("log")
    ax.set_title("(b) total upload (MB)")
    for ax in axes[:2]:
        ax.set_xticks(range(len(specs)), specs, rotation=20, ha="right", fontsize=7)
    memory: dict[str, float] = {}
    for spec in specs:
        memory.update(_device_memory(run_dir, spec, seeds))
    ax = axes[2]
    names = sorted(memory)
    ax.bar_label(ax.bar(range(len(names)), [memory[m] for m in names], color="tab:green"), fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
    ax.set_title("(c) device training state (MB)")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
    return True
