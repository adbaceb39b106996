"""The report's section on what each device spent (engines/footprint.py Footprint): per method and
device, its largest training memory and what it uploaded, the devices a fleet dropped."""
from __future__ import annotations

from pathlib import Path

from .page import Page, natural, plt_
from .records import jsonl


def devices_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from ..comparison import short_spec
    per = {}  # spec -> {user: (max memory MB, MB up, tokens, dropped rounds, base precision and slices)}
    for spec, by in runs.items():
        rows = [r for r in jsonl(by[min(by)] / "metrics.jsonl") if "memory_mb" in r or r.get("dropped")]
        users = sorted(dict.fromkeys(r["user"] for r in rows), key=natural)  # client order, as the other tables
        if any("memory_mb" in r for r in rows):
            per[spec] = {u: (max((r["memory_mb"] for r in rows if r["user"] == u and "memory_mb" in r), default=0.0),
                             sum(r.get("bytes_up", 0) for r in rows if r["user"] == u) / 2**20,
                             sum(r.get("tokens", 0) for r in rows if r["user"] == u),
                             sum(1 for r in rows if r["user"] == u and r.get("dropped")),
                             next((r["quant"] + (f", {r['micro_batches']} slices" if r.get("micro_batches", 1) > 1 else "")
                                   for r in rows if r["user"] == u and "quant" in r), "-")) for u in users}
    if not per:
        return
    lines = ["| method | device | base | training memory MB (max) | MB up (sum) | tokens (sum) | rounds dropped |",
             "|---|---|---|---|---|---|---|"]
    for spec, by_user in per.items():
        lines += [f"| {short_spec(spec)} | {u} | {q} | {m:.1f} | {up:.3f} | {t:,} | {d} |" for u, (m, up, t, d, q) in by_user.items()]
    page.md("## What each device spent\n\nFirst seed, per device: the largest training memory of its rounds "
            "(frozen base at its precision, \"base\" with the slices its batches were computed in, + trainable state + "
            "one step's activations), what it uploaded, the "
            "tokens it trained on, and the rounds a fleet's deadline or availability left it out.\n\n"
            + "\n".join(lines))
    users = sorted({u for by_user in per.values() for u in by_user}, key=natural)
    if len(users) > 12 and len(per) > 1:  # a bar per device and method would be ~2 px wide: one column of points per method
        _device_spread(page, per, len(users))
        return
    plt = plt_()
    many = len(users) > 12
    fig, axes = plt.subplots(2 if many else 1, 1 if many else 2, figsize=(10, 6.8 if many else 3.9), layout="constrained")
    width = 0.8 / len(per)
    for i, (spec, by_user) in enumerate(per.items()):
        xs = [users.index(u) + i * width for u in by_user]  # a bar at its device's name
        style = page.style(spec).bar()
        axes[0].bar(xs, [v[0] for v in by_user.values()], width, label=short_spec(spec), **style)
        axes[1].bar(xs, [v[1] for v in by_user.values()], width, **style)
    for ax, label in zip(axes, LABELS):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(users))])
        # the devices named as in the tables, however many (7 pt, upright, past 12: 6 pt did not read)
        ax.set_xticklabels(users, rotation=90 if len(users) > 12 else 45 if len(users) > 6 else 0,
                           ha="center" if len(users) > 12 or len(users) <= 6 else "right",
                           fontsize=7 if len(users) > 12 else 9)
        ax.set_xlabel("device")
        ax.set_ylabel(label)
    # the legend above the bars: inside the axes it covered the last devices' bars
    fig.legend(fontsize=8, loc="outside upper center", ncol=min(4, len(per)))
    page.fig(fig, "devices.png", "Each device's largest training memory and what it uploaded, per method (first seed)")


LABELS = ("training memory MB (max)", "MB uploaded (sum)")


def _device_spread(page: Page, per: dict, n_devices: int) -> None:
    """Many devices under several methods: a column per method, a point per device (spread sideways
    so equal values stay apart), the median as a bar across; the table above names each device."""
    import numpy as np

    from ..comparison import short_spec
    plt = plt_()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    offsets = np.linspace(-0.3, 0.3, n_devices)
    for i, (spec, by_user) in enumerate(per.items()):
        color, marker = page.style(spec).color, page.style(spec).marker  # a variant (DP) by its own marker
        for ax, k in zip(axes, (0, 1)):
            values = [v[k] for v in by_user.values()]
            ax.scatter(i + offsets[:len(values)], values, s=10, color=color, marker=marker, alpha=0.8, lw=0)
            ax.hlines(float(np.median(values)), i - 0.38, i + 0.38, color=color, lw=1.5)
    for ax, label in zip(axes, LABELS):
        ax.set_xticks(range(len(per)), [short_spec(s) for s in per], rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(per) - 0.4)
        ax.set_ylabel(label)
    page.fig(fig, "devices.png", f"Each of the {n_devices} devices' largest training memory and what it uploaded, per "
             "method (first seed): a point per device in client order from left to right, the line across is the "
             "median; the table above gives each device's numbers")
