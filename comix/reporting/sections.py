"""The report's sections drawn from results.json and metrics.jsonl: results (with utility against
epsilon when DP was on), learning curves and training loss, expert scores, traffic, privacy."""
from __future__ import annotations

import statistics
from pathlib import Path

from .page import COLORS, Page, plt_, round_axis
from .records import jsonl, results_of, scoring_rule


def results_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from ..comparison import _mean_std, metric_of, metric_title, privacy_table, user_table
    from .figures import privacy_figure
    results = results_of(runs)
    title = metric_title([r for by in results.values() for r in by.values()])
    private = any(r.get("epsilon") is not None for by in results.values() for r in by.values())
    rows = [f"| method | {title}: mean over users (population std over seeds) | seeds |{' epsilon |' if private else ''} "
            "scored model |", "|---|---|---|---|" + ("---|" if private else "")]
    for spec, by in results.items():
        eps = next(iter(by.values())).get("epsilon")
        rows.append(f"| {spec} | {_mean_std([metric_of(r)[1] for r in by.values()])} | {len(by)} |"
                    + (f" {'-' if eps is None else f'{eps:.3g}'} |" if private else "") + f" {scoring_rule(spec)} |")
    users = list(dict.fromkeys(u for by in results.values() for r in by.values() for u in r["per_user"]))
    cells = {spec: [_mean_std(xs) if (xs := [r["per_user"][u][metric_of(r)[0]] for r in by.values()
                                             if metric_of(r)[0] in r["per_user"].get(u, {})]) else "-" for u in users]
             for spec, by in results.items()}
    page.md("## Results\n\n" + "\n".join(rows) + "\n\nPer user (mean over seeds):\n\n" + user_table(cells, users))
    table = privacy_table(results)
    if table:
        page.md("### Utility against privacy\n\nClient-level DP-FedAvg (`comix/privacy.py`): each private run's clip, "
                "noise multiplier and epsilon after the last round, beside the noise-free run.\n\n" + table)
        fig = privacy_figure(results)
        if fig is not None:
            page.fig(fig, "privacy.png", f"{title} against epsilon (log scale); dashed: the same method without DP")


def _per_round(runs, key_of) -> dict[str, dict[str, dict[int, list[float]]]]:
    """{spec: {user: {round: [value per seed]}}} of what ``key_of(row)`` finds in metrics.jsonl."""
    data: dict = {}
    for spec, by in runs.items():
        for d in by.values():
            for r in jsonl(d / "metrics.jsonl"):
                v = key_of(r)
                if v is not None:
                    data.setdefault(spec, {}).setdefault(r["user"], {}).setdefault(r["round"], []).append(v)
    return data


def _mean_by_round(by_user: dict[str, dict[int, list[float]]]) -> list[tuple[int, float]]:
    rounds = sorted({rnd for v in by_user.values() for rnd in v})
    return [(rnd, statistics.fmean(statistics.fmean(v[rnd]) for v in by_user.values() if rnd in v)) for rnd in rounds]


def curves_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    """The task metric per evaluated round (lines), or, when only one round was evaluated (the
    main job scores the last), a bar per method, per user; then the training loss per round."""
    from ..engines.server import task_score
    plt = plt_()
    metric = next((sc[0] for by in runs.values() for d in by.values() for r in jsonl(d / "metrics.jsonl")
                   if (sc := task_score(r))), None)
    data = _per_round(runs, lambda r: (task_score(r) or (None, None))[1])
    refs = {spec: statistics.fmean(r["mean"] for r in by.values()) for spec, by in results_of(runs).items()
            if spec not in data and all(r["rounds"] == 0 for r in by.values())}  # Pretrained: a reference line
    if data:
        label = metric.replace("_", " ")
        rounds = {rnd for by in data.values() for u in by.values() for rnd in u}
        users = sorted({u for by in data.values() for u in by})
        page.md("## Learning curves" if len(rounds) > 1 else
                f"## Final scores\n\nOnly round {max(rounds)} was evaluated (`train.eval_every`): a bar per method "
                "instead of a curve; set `train.eval_every=1` for learning curves.")
        fig, ax = plt.subplots(figsize=(7, 3.8))
        if len(rounds) > 1:
            for i, (spec, by_user) in enumerate(data.items()):
                ax.plot(*zip(*_mean_by_round(by_user)), marker="o", color=COLORS[i % len(COLORS)], label=spec)
            for spec, level in refs.items():
                ax.axhline(level, ls="--", lw=1, color="grey", label=spec)
            round_axis(ax, rounds)
            ax.set_xlabel("round")
            ax.legend(fontsize=8)
        else:
            names = [*data, *refs]  # the same colour per method as in the per-user panels; references grey
            values = [*(_mean_by_round(by)[-1][1] for by in data.values()), *refs.values()]
            bars = ax.bar(range(len(names)), values, color=[COLORS[i % len(COLORS)] for i in range(len(data))]
                          + ["#999999"] * len(refs))
            ax.bar_label(bars, fmt="%.4g", fontsize=8)
            ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0, ha="right"
                          if len(names) > 4 else "center", fontsize=8)
            ax.set_ylim(0, max(values) * 1.15)
        ax.set_ylabel(label)
        fig.tight_layout()
        page.fig(fig, "curves.png", f"{label} {'per evaluated round' if len(rounds) > 1 else 'of each method'}, "
                                    "mean over users and seeds")
        if 1 < len(users) <= 8:
            per_user_refs = {spec: {u: m.get(metric) for u, m in by[min(by)]["per_user"].items() if m.get(metric) is not None}
                             for spec, by in results_of(runs).items() if spec in refs}
            page.fig(_per_user_figure(data, users, rounds, label, per_user_refs), "curves-per-user.png",
                     "the same, one panel per user")
    loss = _per_round(runs, lambda r: r.get("train_loss"))
    if loss:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        rounds = {rnd for by in loss.values() for u in by.values() for rnd in u}
        for i, (spec, by_user) in enumerate(loss.items()):
            ax.plot(*zip(*_mean_by_round(by_user)), marker="o", color=COLORS[i % len(COLORS)], label=spec)
        round_axis(ax, rounds)
        ax.set_xlabel("round")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
        fig.tight_layout()
        page.md("## Training loss")
        page.fig(fig, "train-loss.png", "mean training loss of the round's local steps, mean over users and seeds")


def _per_user_figure(data, users, rounds, label, refs=None):
    """One panel per user: curves over rounds, or (one evaluated round) a bar per method from 0 with
    its value on it and its name below; references (Pretrained) as grey dashed lines."""
    plt = plt_()
    cols = min(4, len(users))
    nrows = (len(users) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
    for k, (ax, user) in enumerate(zip(axes.flat, users)):
        specs = [s for s in data if user in data[s]]
        if len(rounds) > 1:
            for i, spec in enumerate(data):
                if user in data[spec]:
                    pts = sorted((rnd, statistics.fmean(v)) for rnd, v in data[spec][user].items())
                    ax.plot(*zip(*pts), marker="o", ms=3, color=COLORS[i % len(COLORS)], label=spec)
            round_axis(ax, rounds)
            if k // cols == nrows - 1 or k + cols >= len(users):
                ax.set_xlabel("round", fontsize=8)
        else:  # bars from 0, as the mean chart: their values written on them carry the differences
            values = [statistics.fmean(next(iter(data[s][user].values()))) for s in specs]
            bars = ax.bar(range(len(specs)), values, color=[COLORS[list(data).index(s) % len(COLORS)] for s in specs])
            ax.bar_label(bars, fmt="%.4g", fontsize=6)
            ax.set_xticks(range(len(specs)), specs, rotation=30, ha="right", fontsize=6)
            ax.set_ylim(0, max(values + [v.get(user, 0) for v in (refs or {}).values()]) * 1.15)
        for spec, by_user in (refs or {}).items():
            if user in by_user:
                ax.axhline(by_user[user], ls="--", lw=1, color="grey")
        ax.yaxis.set_major_locator(plt.MaxNLocator(4))
        ax.tick_params(labelsize=7)
        ax.set_title(user, fontsize=9)
        if k % cols == 0:
            ax.set_ylabel(label, fontsize=8)
    for ax in list(axes.flat)[len(users):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=COLORS[i % len(COLORS)]) for i in range(len(data))]
    names = list(data)
    if refs:
        handles.append(plt.Line2D([], [], ls="--", color="grey"))
        names.append(" / ".join(refs) + " (dashed)")
    fig.legend(handles, names, fontsize=7, loc="upper center", ncol=min(5, len(names)))
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def _mean_or_nan(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def gates_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
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
        users = everyone[:GATE_USERS]
        cols = min(GATE_COLUMNS, len(users))
        blocks = -(-len(users) // cols)  # rows of `cols` users, two panels each (by round, per layer)
        fig, grid = plt.subplots(2 * blocks, cols, figsize=(max(6.0, 3.2 * cols), 5.6 * blocks), squeeze=False,
                                 layout="constrained")  # titles, labels and the colour bar kept apart
        pairs = [[grid[2 * (j // cols), j % cols], grid[2 * (j // cols) + 1, j % cols]] for j in range(len(users))]
        used = {id(ax) for pair in pairs for ax in pair}
        for ax in grid.flat:
            ax.set_visible(id(ax) in used)
        axes = _Columns(pairs)
        for j, user in enumerate(users):
            mine = sorted((r["round"], r["gates"]) for r in rows if r["user"] == user)
            # FedAMoLE gives each module its own number of expert slots (eq. 21's K_c differs by
            # module): a slot's line averages the layers that have it, missing cells stay blank; a
            # round in which no module had the slot yet (RSEA gave the client fewer experts) too
            n = max(len(layer) for layer in mine[-1][1])
            for e in range(n):
                axes[0, j].plot([rnd for rnd, _ in mine],
                                [_mean_or_nan([layer[e] for layer in g if len(layer) > e]) for _, g in mine],
                                marker="o", ms=3, color=COLORS[e % len(COLORS)], label=f"expert {e}")
            axes[0, j].set_title(user, fontsize=9)
            axes[0, j].set_ylim(0, 1)
            round_axis(axes[0, j], [rnd for rnd, _ in mine])
            axes[0, j].set_xlabel("round", fontsize=8)
            last = [[layer[e] if len(layer) > e else float("nan") for layer in mine[-1][1]] for e in range(n)]
            im = axes[1, j].imshow(last, aspect="auto", vmin=0, vmax=1, cmap="viridis")
            axes[1, j].set_xlabel("layer", fontsize=8)
            axes[1, j].xaxis.set_major_locator(plt.MaxNLocator(5, integer=True))
            axes[1, j].yaxis.set_major_locator(plt.MaxNLocator(integer=True))
            for ax in (axes[0, j], axes[1, j]):
                ax.tick_params(labelsize=7)
        axes[0, 0].legend(fontsize=7)
        axes[0, 0].set_ylabel("mean gate", fontsize=8)
        axes[1, 0].set_ylabel("expert", fontsize=8)
        bar = fig.colorbar(im, ax=[axes[1, j] for j in range(len(users))], shrink=0.8)
        bar.set_label("mean gate (last round)", fontsize=8)
        left_out = (f"; drawn for the first {len(users)} of {len(everyone)} clients ({users[0]} to {users[-1]}), "
                    "every client's gates are in its metrics.jsonl") if len(everyone) > len(users) else ""
        page.fig(fig, f"gates-{_slug(spec)}.png", f"{spec}: mean gate per expert by round (top), per layer at the "
                                                  f"last round (bottom){left_out}")


GATE_USERS, GATE_COLUMNS = 8, 4  # users drawn, and per row of the figure (a 1100 px page reads 4)


class _Columns:
    """``axes[k, j]``: user j's panel k (0: by round, 1: per layer), wherever the grid put it."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __getitem__(self, key):
        k, j = key
        return self.pairs[j][k]


def traffic_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    lines = ["| method | round | clients uploading | MB up (sum) | MB down (sum) | mean update norm | train s (max) | epsilon |",
             "|---|---|---|---|---|---|---|---|"]
    silent = []
    for spec, by in runs.items():
        rows = jsonl(by[min(by)] / "metrics.jsonl")
        if rows and not any(r.get("bytes_up") or r.get("bytes_down") for r in rows):
            silent.append(spec)  # Local: one line, not rows of zeros
            continue
        for rnd in sorted({r["round"] for r in rows}):
            mine = [r for r in rows if r["round"] == rnd and r.get("evaluated_by") != "server"]
            up = [r for r in mine if r.get("bytes_up")]
            norms = [r["update_norm"] for r in mine if "update_norm" in r]
            eps = next((r["epsilon"] for r in mine if "epsilon" in r), None)
            cells = [spec, rnd, len(up), f"{sum(r['bytes_up'] for r in mine) / 2**20:.3f}",
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
    for spec, by in runs.items():
        f = by[min(by)] / "privacy.md"
        if f.exists():
            text = f.read_text()
            head = text.split("## Upload listings")[0].replace("# What left each device", "## What left each device")
            page.md(head.strip() + f"\n\n(full tensor listings: `{f}`)")


def _slug(spec: str) -> str:
    from ..specs import spec_dirname
    return spec_dirname(spec)
