"""Sections drawn from server.jsonl: FedAMoLE's expert assignment (Fig. 8) and solve times;
DeepFusion's KD loss terms per step, device embeddings by cluster and true domain, the global
MoE's expert load per test domain."""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from .page import COLORS, Page, plt_
from .records import jsonl
from .sections import _slug


def server_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from .figures import plot_assignment
    from matplotlib.ticker import MaxNLocator
    plt = plt_()
    for spec, by in runs.items():
        seed, d = min(by.items())
        rows = jsonl(d / "server.jsonl")
        if any("assignment" in r or "relevance" in r for r in rows):
            with tempfile.TemporaryDirectory() as tmp:
                target = Path(tmp) / "a.png"
                run_root = d.parent.parent if d.parent.name.startswith("seed") else None
                if run_root is not None and plot_assignment(run_root, spec, seed, target):
                    page.md(f"## {spec}: expert assignment")
                    page.blocks.append(("fig", f"assignment-{_slug(spec)}.png", target.read_bytes(),
                                        f"{spec}: experts per client and selection probabilities over rounds (Fig. 8)"))
            solve = [r.get("solve_s") for r in rows if r.get("solve_s") is not None]
            if solve:
                page.md(f"RSEA solve time per round: mean {statistics.fmean(solve):.3g} s, max {max(solve):.3g} s.")
        kd = [r["kd"] for r in rows if r.get("kd")]
        if kd:
            fig, ax = plt.subplots(figsize=(6.5, 3.6))
            for k, term in enumerate(kd[0]):
                for t, style in (("ce", "-"), ("fm", "--"), ("kl", ":")):
                    ys = term.get("steps", {}).get(t)
                    if ys:
                        ax.plot(range(1, len(ys) + 1), ys, style, color=COLORS[k % len(COLORS)],
                                label=f"domain {k} {t.upper()}")
            ax.set_xlabel("KD step")
            ax.set_ylabel("loss")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7, ncol=3)  # 6 pt did not read at the page's width
            fig.tight_layout()
            page.md(f"## {spec}: distillation")
            page.fig(fig, f"kd-{_slug(spec)}.png", f"{spec}: CE (solid), FM (dashed) and KL (dotted) per KD step, "
                                                    "one colour per domain")
            first = rows[0]
            true = _true_domains(by[min(by)], len(first.get("domains", [])))
            if first.get("embedding_2d"):
                pts = first["embedding_2d"]
                views = [("cluster", first.get("domains", [0] * len(pts)))]
                if true:  # the data's dominant category (partition.json): did clustering find it?
                    names = sorted(set(true))
                    views.append(("true domain", [names.index(t) for t in true]))
                fig, axes = plt.subplots(1, len(views), figsize=(4.6 * len(views), 3.8), squeeze=False)
                for ax, (what, labels) in zip(axes[0], views):
                    for k in sorted(set(labels)):
                        mine = [p for p, lab in zip(pts, labels) if lab == k]
                        name = f"cluster {k}" if what == "cluster" else names[k]
                        ax.scatter([p[0] for p in mine], [p[1] for p in mine], color=COLORS[k % len(COLORS)], label=name)
                    for i, p in enumerate(pts):
                        ax.annotate(f"client{first.get('clients', range(len(pts)))[i]}", p, fontsize=7)
                    ax.set_title(f"coloured by {what}", fontsize=9)
                    ax.set_xlabel("principal component 1")
                    ax.set_ylabel("principal component 2")
                    ax.legend(fontsize=7)
                fig.tight_layout()
                page.fig(fig, f"embeddings-{_slug(spec)}.png", f"{spec}: the devices' data embeddings (first two "
                                                                "principal components), coloured by the server's cluster"
                                                                + (" and by each device's dominant true domain" if true else ""))
            loads = [r for r in jsonl(by[min(by)] / "metrics.jsonl")
                     if r.get("evaluated_by") == "server" and r.get("expert_load")]
            if loads:
                last = [r for r in loads if r["round"] == loads[-1]["round"]]
                grid = [r["expert_load"] for r in last]
                fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(grid[0]), 0.8 + 0.4 * len(grid)))
                im = ax.imshow(grid, cmap="viridis", vmin=0, aspect="auto")
                ax.set_xticks(range(len(grid[0])), [f"expert {j}" for j in range(len(grid[0]))], fontsize=7,
                              rotation=45 if len(grid[0]) > 4 else 0, ha="right" if len(grid[0]) > 4 else "center")
                ax.set_yticks(range(len(last)), [r["user"] for r in last], fontsize=7)
                for i, row in enumerate(grid):
                    for j, v in enumerate(row):
                        top = max(max(r) for r in grid)  # dark cells (low load) get white text
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.5 * top else "k")
                fig.colorbar(im, ax=ax, fraction=0.05).set_label("share of top-k routing slots", fontsize=7)
                fig.tight_layout()
                page.fig(fig, f"expert-load-{_slug(spec)}.png", f"{spec}: the global MoE's expert load per test "
                                                                 "domain (share of top-k routing slots, mean over layers)")
            if "domains" in first and "devices" in first:
                known = first.get("in_domain", {})  # nats per character on the device's own domain
                dev, stu = known.get("devices", {}), known.get("student", {})

                def client(i):
                    return str(first.get("clients", range(len(first["devices"])))[i])

                def knows(i):
                    c = client(i)
                    if not (true and c in dev and true[i] in dev[c]):
                        return "- | -"
                    return f"{dev[c][true[i]]:.4f} | {stu[true[i]]:.4f}"
                public = known.get("public", {})  # the same on the public text the distillation runs on

                def knows_public(i):
                    if client(i) not in public.get("devices", {}):
                        return "- | -"
                    return f"{public['devices'][client(i)]['all']:.4f} | {public['student']['all']:.4f}"
                page.md("| device | model | cluster | dominant true domain | its log ppl there (nats/char) | the "
                        "student's | its log ppl on the public text | the student's |\n|---|---|---|---|---|---|---|---|\n"
                        + "\n".join(f"| client{i} | {m} | {c} | {true[i] if true else '-'} | {knows(i)} | {knows_public(i)} |"
                                     for i, (m, c) in enumerate(zip(first["devices"], first["domains"]))))


def _true_domains(method_dir: Path, n: int) -> list[str] | None:
    """Each client's largest category (and its share) from the run's partition.json (Dirichlet
    clients record their mixtures); None when the run recorded none for ``n`` clients."""
    for folder in (method_dir.parent, method_dir.parent.parent):
        path = folder / "partition.json"
        if path.exists():
            mixes = [row.get("mixture") for row in json.loads(path.read_text()).values()]
            if len(mixes) == n and all(mixes):
                return [max(m, key=m.get) for m in mixes]
    return None
