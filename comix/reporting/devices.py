"""The report's section on what each device spent (engines/footprint.py Footprint): per method and
device, its largest training memory and what it uploaded, the devices a fleet dropped."""
from __future__ import annotations

from pathlib import Path

from .page import COLORS, Page, plt_
from .records import jsonl


def _natural(name: str):
    """client2 before client10."""
    import re
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def devices_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    per = {}  # spec -> {user: (max memory MB, MB up, tokens, dropped rounds, base precision and slices)}
    for spec, by in runs.items():
        rows = [r for r in jsonl(by[min(by)] / "metrics.jsonl") if "memory_mb" in r or r.get("dropped")]
        users = sorted(dict.fromkeys(r["user"] for r in rows), key=_natural)  # client order, as the other tables
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
        lines += [f"| {spec} | {u} | {q} | {m:.1f} | {up:.3f} | {t:,} | {d} |" for u, (m, up, t, d, q) in by_user.items()]
    page.md("## What each device spent\n\nFirst seed, per device: the largest training memory of its rounds "
            "(frozen base at its precision, \"base\" with the slices its batches were computed in, + trainable state + "
            "one step's activations), what it uploaded, the "
            "tokens it trained on, and the rounds a fleet's deadline or availability left it out.\n\n"
            + "\n".join(lines))
    plt = plt_()
    many = len(next(iter(per.values()))) > 12
    fig, axes = plt.subplots(2 if many else 1, 1 if many else 2, figsize=(10, 6.4 if many else 3.6))
    width = 0.8 / len(per)
    for i, (spec, by_user) in enumerate(per.items()):
        xs = [j + i * width for j in range(len(by_user))]
        axes[0].bar(xs, [v[0] for v in by_user.values()], width, label=spec, color=COLORS[i % len(COLORS)])
        axes[1].bar(xs, [v[1] for v in by_user.values()], width, label=spec, color=COLORS[i % len(COLORS)])
    users = list(next(iter(per.values())))
    for ax, label in zip(axes, ("training memory MB (max)", "MB uploaded (sum)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(users))])
        # the devices named as in the tables, however many (a small font, upright, past 12)
        ax.set_xticklabels(users, rotation=90 if len(users) > 12 else 45 if len(users) > 6 else 0,
                           ha="center" if len(users) > 12 or len(users) <= 6 else "right",
                           fontsize=6 if len(users) > 12 else 9)
        ax.set_xlabel("device")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    page.fig(fig, "devices.png", "Each device's largest training memory and what it uploaded, per method (first seed)")
