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
    plt = plt_()
    many = len({u for by_user in per.values() for u in by_user}) > 12
    fig, axes = plt.subplots(2 if many else 1, 1 if many else 2, figsize=(10, 6.8 if many else 3.9), layout="constrained")
    width = 0.8 / len(per)
    users = sorted({u for by_user in per.values() for u in by_user}, key=natural)  # a bar at its device's name
    for i, (spec, by_user) in enumerate(per.items()):
        xs = [users.index(u) + i * width for u in by_user]
        style = page.style(spec).bar()
        axes[0].bar(xs, [v[0] for v in by_user.values()], width, label=short_spec(spec), **style)
        axes[1].bar(xs, [v[1] for v in by_user.values()], width, **style)
    for ax, label in zip(axes, ("training memory MB (max)", "MB uploaded (sum)")):
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
