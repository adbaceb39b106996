"""The report's learning curves (task metric per evaluated round) and training loss: the mean over
users with a band of the population std over seeds, or a bar per method (error bar: the same std)
when one round was evaluated; one panel per user; each method in its page colour, its short name
(comparison.short_spec) in the legend, the legend beside the plot, never over its data."""
from __future__ import annotations

import statistics
from pathlib import Path

from .page import REFERENCE, Page, natural, plt_, round_axis
from .records import jsonl, results_of

Curves = dict  # {spec: {seed: {user: {round: value}}}}


def records(runs: dict[str, dict[int, Path]], key_of) -> Curves:
    """What ``key_of(row)`` finds in each run's metrics.jsonl, by method, seed, user and round."""
    out: dict = {}
    for spec, by in runs.items():
        for seed, d in by.items():
            for r in jsonl(d / "metrics.jsonl"):
                v = key_of(r)
                if v is not None:
                    out.setdefault(spec, {}).setdefault(seed, {}).setdefault(r["user"], {})[r["round"]] = v
    return out


def mean_curve(by_seed: dict) -> list[tuple[int, float, float]]:
    """(round, mean over seeds of the mean over the users scored that round, population std over seeds)."""
    rounds = sorted({rnd for users in by_seed.values() for u in users.values() for rnd in u})
    out = []
    for rnd in rounds:
        per_seed = [statistics.fmean(u[rnd] for u in users.values() if rnd in u)
                    for users in by_seed.values() if any(rnd in u for u in users.values())]
        out.append((rnd, statistics.fmean(per_seed), statistics.pstdev(per_seed)))
    return out


def user_values(by_seed: dict, user: str, rnd: int) -> list[float]:
    return [users[user][rnd] for users in by_seed.values() if rnd in users.get(user, {})]


def _lines(page: Page, ax, data: Curves, refs: dict[str, float]) -> None:
    from ..comparison import short_spec
    for spec, by_seed in data.items():
        pts = mean_curve(by_seed)
        rnds, means, stds = zip(*pts)
        ax.plot(rnds, means, ms=4, label=short_spec(spec), **page.style(spec).line())
        if len(by_seed) > 1:  # the spread over seeds, a band
            ax.fill_between(rnds, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                            color=page.style(spec).color, alpha=0.18, lw=0)
    for spec, level in refs.items():
        ax.axhline(level, ls="--", lw=1, color=REFERENCE, label=short_spec(spec))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: over no data


def _sample_note(data: Curves) -> str:
    """What the mean of a round is over, when the rounds before the last scored a sample of the
    clients (``train.eval_clients``): the curve's points are then over different clients."""
    sizes: dict[int, int] = {}  # round -> clients scored (the most of any method and seed)
    for by_seed in data.values():
        for users in by_seed.values():
            for rnd in {r for u in users.values() for r in u}:
                sizes[rnd] = max(sizes.get(rnd, 0), sum(rnd in u for u in users.values()))
    everyone = max(sizes.values())
    fewer = sorted(r for r, n in sizes.items() if n < everyone)
    if not fewer:
        return ""
    n = sorted({sizes[r] for r in fewer})
    return (f"; rounds {fewer[0]} to {fewer[-1]} scored a sample of {'/'.join(map(str, n))} of the {everyone} clients "
            "(`train.eval_clients`, a new sample each round, named in metrics.jsonl), the others all of them")


# per-user bars are read against the untrained base: a page without it says why it is missing
NO_REFERENCE = "; no Pretrained reference: this run's methods did not include `pretrained` (add it to `methods` to draw it)"


def curves_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    """The task metric per evaluated round (lines), or, when only one round was evaluated (the
    main job scores the last), a bar per method, per user; then the training loss per round."""
    from ..comparison import short_spec
    from ..engines.server import task_score
    plt = plt_()
    metric = next((sc[0] for by in runs.values() for d in by.values() for r in jsonl(d / "metrics.jsonl")
                   if (sc := task_score(r))), None)
    data = records(runs, lambda r: (task_score(r) or (None, None))[1])
    results = results_of(runs)
    refs = {spec: statistics.fmean(r["mean"] for r in by.values()) for spec, by in results.items()
            if spec not in data and all(r["rounds"] == 0 for r in by.values())}  # Pretrained: a reference line
    seeds = max(len(by) for by in runs.values())
    spread = " (band: population std over seeds)" if seeds > 1 else ""
    if data:
        label = metric.replace("_", " ")
        rounds = {rnd for by in data.values() for users in by.values() for u in users.values() for rnd in u}
        users = sorted({u for by in data.values() for users in by.values() for u in users}, key=natural)
        page.md("## Learning curves" if len(rounds) > 1 else
                f"## Final scores\n\nOnly round {max(rounds)} was evaluated (`train.eval_every`): a bar per method "
                "instead of a curve; set `train.eval_every=1` for learning curves.")
        if len(rounds) > 1:
            fig, ax = plt.subplots(figsize=(10, 3.8))
            _lines(page, ax, data, refs)
            round_axis(ax, rounds)
            ax.set_xlabel("round")
        else:
            fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * (len(data) + len(refs))), 3.8))
            names = [*data, *refs]
            values = [*(mean_curve(by)[-1][1] for by in data.values()), *refs.values()]
            errs = [*(mean_curve(by)[-1][2] for by in data.values()), *(0.0 for _ in refs)]
            for i, spec in enumerate(names):
                style = page.style(spec) if spec in data else None
                bar = ax.bar([i], [values[i]], yerr=[errs[i]] if seeds > 1 else None, capsize=4,
                             **(style.bar() if style else {"color": REFERENCE}))
                ax.bar_label(bar, fmt="%.4g", fontsize=8, padding=2)
            ax.set_xticks(range(len(names)), [short_spec(s) for s in names], rotation=20 if len(names) > 4 else 0,
                          ha="right" if len(names) > 4 else "center", fontsize=8)
            ax.set_ylim(0, max(v + e for v, e in zip(values, errs)) * 1.15)
            spread = spread.replace("band", "error bar")
        ax.set_ylabel(label)
        fig.tight_layout()
        page.fig(fig, "curves.png", f"{label} {'per evaluated round' if len(rounds) > 1 else 'of each method'}, "
                                    f"mean over users and seeds{spread}{_sample_note(data)}")
        if 1 < len(users) <= 8:
            per_user_refs = {spec: {u: m.get(metric) for u, m in by[min(by)]["per_user"].items() if m.get(metric) is not None}
                             for spec, by in results.items() if spec in refs}
            page.fig(_per_user_figure(page, data, users, rounds, label, per_user_refs), "curves-per-user.png",
                     "the same, one panel per user" + (", the grey dashed line " + " / ".join(map(short_spec, refs))
                                                       if refs else NO_REFERENCE) + spread.replace("band", "bands"))
    loss = records(runs, lambda r: r.get("train_loss"))
    if loss:
        fig, ax = plt.subplots(figsize=(10, 3.4))
        _lines(page, ax, loss, {})
        round_axis(ax, {rnd for by in loss.values() for users in by.values() for u in users.values() for rnd in u})
        ax.set_xlabel("round")
        ax.set_ylabel("training loss")
        fig.tight_layout()
        page.md("## Training loss")
        page.fig(fig, "train-loss.png", "mean training loss of the round's local steps, mean over users and seeds" + spread)


def _per_user_figure(page: Page, data: Curves, users, rounds, label, refs=None):
    """One panel per user: curves over rounds, or (one evaluated round) a bar per method from 0 with
    its value on it and its short name below; references (Pretrained) as grey dashed lines. 11
    inches for four panels a row: the page shows it unscaled, so 7-pt text reads."""
    from ..comparison import short_spec
    plt = plt_()
    cols = min(4, len(users))
    nrows = (len(users) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.75 * cols, 3.0 * nrows), squeeze=False)
    for k, (ax, user) in enumerate(zip(axes.flat, users)):
        specs = [s for s in data if any(user in users_ for users_ in data[s].values())]
        if len(rounds) > 1:
            for spec in specs:
                pts = sorted((rnd, statistics.fmean(v), statistics.pstdev(v)) for rnd in rounds
                             if (v := user_values(data[spec], user, rnd)))
                rnds, means, stds = zip(*pts)
                ax.plot(rnds, means, ms=3, **page.style(spec).line())
                if len(data[spec]) > 1:
                    ax.fill_between(rnds, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                                    color=page.style(spec).color, alpha=0.18, lw=0)
            round_axis(ax, rounds)
            if k // cols == nrows - 1 or k + cols >= len(users):
                ax.set_xlabel("round", fontsize=8)
        else:  # bars from 0, as the mean chart: their values written on them carry the differences
            rnd = next(iter(rounds))
            vals = [user_values(data[s], user, rnd) for s in specs]
            values = [statistics.fmean(v) for v in vals]
            errs = [statistics.pstdev(v) if len(v) > 1 else 0.0 for v in vals]
            for i, spec in enumerate(specs):
                bar = ax.bar([i], [values[i]], yerr=[errs[i]] if errs[i] else None, capsize=3, **page.style(spec).bar())
                ax.bar_label(bar, fmt="%.4g", fontsize=7, padding=1)
            ax.set_xticks(range(len(specs)), [short_spec(s) for s in specs], rotation=30, ha="right", fontsize=7)
            ax.set_ylim(0, max([v + e for v, e in zip(values, errs)] + [v.get(user, 0) for v in (refs or {}).values()]) * 1.18)
        for spec, by_user in (refs or {}).items():
            if user in by_user:
                ax.axhline(by_user[user], ls="--", lw=1, color=REFERENCE)
        ax.yaxis.set_major_locator(plt.MaxNLocator(4))
        ax.tick_params(labelsize=7)
        ax.set_title(user, fontsize=9)
        if k % cols == 0:
            ax.set_ylabel(label, fontsize=8)
    for ax in list(axes.flat)[len(users):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], lw=2, **page.style(s).line()) for s in data]
    names = [short_spec(s) for s in data]
    if refs:
        handles.append(plt.Line2D([], [], ls="--", color=REFERENCE))
        names.append(" / ".join(map(short_spec, refs)) + " (dashed)")
    fig.legend(handles, names, fontsize=8, loc="upper center", ncol=min(5, len(names)))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.1 * ((len(names) + 4) // 5) / nrows))
    return fig
