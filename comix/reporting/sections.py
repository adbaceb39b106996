"""The report's sections drawn from results.json and metrics.jsonl: results (with utility against
epsilon when DP was on), expert scores, traffic, privacy (learning curves and training loss: curves.py)."""
from __future__ import annotations

import statistics
from pathlib import Path

from .page import EXPERT_COLORS, Page, natural, plt_, round_axis
from .records import jsonl, results_of, scoring_rule


def results_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from ..comparison import _mean_std, metric_of, metric_title, privacy_table, short_spec, user_table
    from .figures import privacy_figure
    results = results_of(runs)
    title = metric_title([r for by in results.values() for r in by.values()])
    private = any(r.get("epsilon") is not None for by in results.values() for r in by.values())
    rows = [f"| method | {title}: mean over users (population std over seeds) | seeds |{' epsilon |' if private else ''} "
            "scored model |", "|---|---|---|---|" + ("---|" if private else "")]
    for spec, by in results.items():
        eps = next(iter(by.values())).get("epsilon")
        rows.append(f"| {short_spec(spec)} | {_mean_std([metric_of(r)[1] for r in by.values()])} | {len(by)} |"
                    + (f" {'-' if eps is None else f'{eps:.3g}'} |" if private else "") + f" {scoring_rule(spec)} |")
    users = list(dict.fromkeys(u for by in results.values() for r in by.values() for u in r["per_user"]))
    cells = {short_spec(spec): [_mean_std(xs) if (xs := [r["per_user"][u][metric_of(r)[0]] for r in by.values()
                                             if metric_of(r)[0] in r["per_user"].get(u, {})]) else "-" for u in users]
             for spec, by in results.items()}
    page.md("## Results\n\n" + "\n".join(rows) + "\n\nPer user (mean over seeds):\n\n" + user_table(cells, users))
    table = privacy_table(results)
    if table:
        page.md("### Utility against privacy\n\nClient-level DP-FedAvg (`comix/privacy.py`): each private run's clip, "
                "noise multiplier and epsilon after the last round, beside the noise-free run.\n\n" + table)
        fig = privacy_figure(results, page.styles)
        if fig is not None:
            page.fig(fig, "privacy.png", f"{title} against epsilon (log scale), each epsilon with its noise multiplier sigma; "
                     "error bars: population std over seeds; dashed: the same method without DP")


def _expert(e: int) -> str:
    return EXPERT_COLORS[e % len(EXPERT_COLORS)]


def _mean_or_nan(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def gates_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from ..comparison import short_spec
    plt = plt_()
    drawn = False
    for spec, by in runs.items():
        d = by[min(by)]
        rows = [r for r in jsonl(d / "metrics.jsonl") if "gates" in r]
        if not rows:
            continue
        if not drawn:
            page.md("## Expert scores over training\n\nMean gate of each expert (expert 0: the generalist where "
                    "the method has one) on a validation batch, per user, by evaluated round: averaged over layers "
                    "(top) and per layer at the last round (bottom). CoMiGS Fig. 4 / 10.")
            drawn = True
        everyone = list(dict.fromkeys(r["user"] for r in rows))
        users = sorted(everyone[:GATE_USERS], key=natural)  # the first scored (the most rounds), in client order
        cols = min(GATE_COLUMNS, len(users))
        blocks = -(-len(users) // cols)  # rows of `cols` users, two panels each (by round, per layer)
        # 11 inches at most: the page shows it unscaled, its 7-pt labels readable (a 12.8-inch one read as 6 pt)
        fig, grid = plt.subplots(2 * blocks, cols, figsize=(max(6.0, 2.75 * cols), 5.6 * blocks), squeeze=False,
                                 layout="constrained")  # titles, labels, legend and the colour bar kept apart
        pairs = [[grid[2 * (j // cols), j % cols], grid[2 * (j // cols) + 1, j % cols]] for j in range(len(users))]
        used = {id(ax) for pair in pairs for ax in pair}
        for ax in grid.flat:
            ax.set_visible(id(ax) in used)
        axes = _Columns(pairs)
        n_max = 0
        for j, user in enumerate(users):
            mine = sorted((r["round"], r["gates"]) for r in rows if r["user"] == user)
            # FedAMoLE gives each module its own number of expert slots (eq. 21's K_c differs by
            # module): a slot's line averages the layers that have it, missing cells stay blank; a
            # round in which no module had the slot yet (RSEA gave the client fewer experts) too
            n = max(len(layer) for layer in mine[-1][1])
            n_max = max(n_max, n)
            means = [[_mean_or_nan([layer[e] for layer in g if len(layer) > e]) for _, g in mine] for e in range(n)]
            if len(mine) > 1:
                for e in range(n):
                    axes[0, j].plot([rnd for rnd, _ in mine], means[e], marker="o", ms=3, color=_expert(e))
                round_axis(axes[0, j], [rnd for rnd, _ in mine])
                axes[0, j].set_xlabel("round", fontsize=8)
            else:  # one evaluated round: a bar per expert with its value, not lone dots
                bars = axes[0, j].bar(range(n), [m[0] for m in means], color=[_expert(e) for e in range(n)])
                axes[0, j].bar_label(bars, fmt="%.2f", fontsize=7)
                axes[0, j].set_xticks(range(n), [str(e) for e in range(n)])
                axes[0, j].set_xlabel(f"expert (round {mine[0][0]})", fontsize=8)
            axes[0, j].set_title(user, fontsize=9)
            axes[0, j].set_ylim(0, 1)
            last = [[layer[e] if len(layer) > e else float("nan") for layer in mine[-1][1]] for e in range(n)]
            im = axes[1, j].imshow(last, aspect="auto", vmin=0, vmax=1, cmap="viridis")
            axes[1, j].set_xlabel("layer", fontsize=8)
            axes[1, j].xaxis.set_major_locator(plt.MaxNLocator(5, integer=True))
            axes[1, j].yaxis.set_major_locator(plt.MaxNLocator(integer=True))
            for ax in (axes[0, j], axes[1, j]):
                ax.tick_params(labelsize=7)
        # the legend above the panels: inside one it covered that user's lines
        fig.legend([plt.Line2D([], [], color=_expert(e), marker="o", ms=3) for e in range(n_max)],
                   [f"expert {e}" for e in range(n_max)], fontsize=8, loc="outside upper center", ncol=min(8, n_max))
        axes[0, 0].set_ylabel("mean gate", fontsize=8)
        axes[1, 0].set_ylabel("expert", fontsize=8)
        bar = fig.colorbar(im, ax=[axes[1, j] for j in range(len(users))], shrink=0.8)
        bar.set_label("mean gate (last round)", fontsize=8)
        left_out = (f"; drawn for {len(users)} of the {len(everyone)} clients, the first scored: {', '.join(users)} "
                    "(every client's gates are in its metrics.jsonl)") if len(everyone) > len(users) else ""
        seed = f", seed {min(by)} of {sorted(by)}" if len(by) > 1 else ""  # one seed drawn: which
        page.fig(fig, f"gates-{_slug(spec)}.png", f"{short_spec(spec)}: mean gate per expert by round (top), per layer "
                                                  f"at the last round (bottom){seed}{left_out}")


GATE_USERS, GATE_COLUMNS = 8, 4  # users drawn, and per row of the figure (a 1100 px page reads 4)


class _Columns:
    """``axes[k, j]``: user j's panel k (0: by round, 1: per layer), wherever the grid put it."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __getitem__(self, key):
        k, j = key
        return self.pairs[j][k]


def traffic_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from ..comparison import short_spec
    lines = ["| method | round | clients uploading | MB up (sum) | MB down (sum) | mean update norm | train s (max) | epsilon |",
             "|---|---|---|---|---|---|---|---|"]
    silent = []
    for spec, by in runs.items():
        rows = jsonl(by[min(by)] / "metrics.jsonl")
        if rows and not any(r.get("bytes_up") or r.get("bytes_down") for r in rows):
            silent.append(short_spec(spec))  # Local: one line, not rows of zeros
            continue
        for rnd in sorted({r["round"] for r in rows}):
            mine = [r for r in rows if r["round"] == rnd and r.get("evaluated_by") != "server"]
            up = [r for r in mine if r.get("bytes_up")]
            norms = [r["update_norm"] for r in mine if "update_norm" in r]
            eps = next((r["epsilon"] for r in mine if "epsilon" in r), None)
            cells = [short_spec(spec), rnd, len(up), f"{sum(r['bytes_up'] for r in mine) / 2**20:.3f}",
                     f"{sum(r.get('bytes_down', 0) for r in mine) / 2**20:.3f}",
                     f"{statistics.fmean(norms):.4g}" if norms else "-",
                     f"{max((r.get('train_s', 0) for r in mine), default=0):.3g}", "-" if eps is None else f"{eps:.3g}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    page.md("## Communication and compute\n\nPer round (first seed): what the clients uploaded and downloaded, "
            "how far their updates moved, the slowest client's training time, and epsilon when DP was on "
            "(CoMiGS Table 3, FedAMoLE Table IV).\n\n" + ("\n".join(lines) if len(lines) > 2 else "")
            + "".join(f"\n\n{spec}: nothing left any device and nothing was sent to one (every model stays local)."
                      for spec in silent))


def privacy_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from ..comparison import short_spec
    for spec, by in runs.items():
        f = by[min(by)] / "privacy.md"
        if f.exists():
            text = f.read_text()
            head = text.split("## Upload listings")[0].replace("# What left each device", "## What left each device")
            head = head.replace(f"device: {spec}\n", f"device: {short_spec(spec)}\n", 1)  # the heading by its short name
            page.md(head.strip() + f"\n\n(full tensor listings: `{f}`)")


def _slug(spec: str) -> str:
    from ..specs import spec_dirname
    return spec_dirname(spec)
