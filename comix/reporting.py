"""`comix report DIR`: one page a person would rather look at than read (issue F1 part 1).

``DIR`` is a run folder (``<run>/<method>/``), a compare folder (``<run>/seed<S>/<method>/``) or one
method folder. The page is built from what the records hold, a section per *kind of record*, so a
method gets every section its records allow:
  results.json ............ results: mean (std) over seeds, per-user table, each method's scoring rule
  metrics.jsonl ........... learning curves (task metric per evaluated round, per method and user);
                            communication and compute (bytes up / down, update norm, time per round)
  metrics.jsonl "gates" ... expert scores over training (CoMiGS Fig. 4 / 10: mean gate per expert
                            and layer, per user, by round)
  adapters + a mixture .... token routing colour maps (CoMiGS Fig. 3, 14-19): test texts of each
                            user, every token coloured by its top-1 expert at the first, middle
                            and last layer (rebuilt with ``personal.rebuild``)
  server.jsonl ............ FedAMoLE's assignment view (Fig. 8) and solve times; DeepFusion's KD
                            loss terms per step and its clusters; epsilon per round
  privacy.md .............. what left each device
Writes ``report.html`` (self-contained: images inline as data URIs, no network) and ``report.md``
(the same content, its images under ``report-files/``), each through a temp file and a rename.
"""
from __future__ import annotations

import base64
import html
import io
import json
import shutil
import statistics
import tempfile
from pathlib import Path

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


class ReportError(ValueError):
    pass


# -- reading ---------------------------------------------------------------------------------------
def find_runs(path: Path) -> dict[str, dict[int, Path]]:
    """{method spec: {seed: method folder}} of a run, compare or method folder."""
    path = Path(path)
    if (path / "results.json").exists() and (path / "metrics.jsonl").exists():
        dirs = [(path, _seed_of(path.parent))]
    else:
        dirs = [(d.parent, int(d.parent.parent.name[4:])) for d in sorted(path.glob("seed*/*/results.json"))]
        dirs += [(d.parent, _seed_of(path)) for d in sorted(path.glob("*/results.json"))
                 if (d.parent / "metrics.jsonl").exists()]
    if not dirs:
        raise ReportError(f"{path} is not a comix run: no <method>/results.json (nor seed<S>/<method>/results.json)")
    out: dict[str, dict[int, Path]] = {}
    for d, seed in dirs:
        spec = json.loads((d / "results.json").read_text())["method"]
        out.setdefault(spec, {})[seed] = d
    return out


def _seed_of(run_dir: Path) -> int:
    import yaml
    cfg = run_dir / "config.yaml"
    return int((yaml.safe_load(cfg.read_text()) or {}).get("seed", 0)) if cfg.exists() else 0


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def scoring_rule(spec: str) -> str:
    """Which model a method's scores are of, from its class (the README's method table)."""
    from .algorithms import REGISTRY
    cls = REGISTRY[spec.split(":")[0]][0]
    if not cls.trains:
        return "the frozen base"
    if cls.needs_server_data:
        return "the server's global model, on the server's test data per domain"
    if cls.pooled:
        return "the one model trained on every user's data"
    if cls.evaluate_local:
        return "each client's model after its local training, before aggregation"
    return "each client's model after it takes the round's new payload"


# -- figures -------------------------------------------------------------------------------------
class Page:
    """Sections of markdown text and figures, rendered to HTML and markdown alike."""

    def __init__(self, title: str):
        self.title, self.blocks = title, []  # ("md", text) | ("fig", name, png bytes, caption) | ("html", html, md)

    def md(self, text: str) -> None:
        self.blocks.append(("md", text))

    def fig(self, fig, name: str, caption: str) -> None:
        import matplotlib.pyplot as plt
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        self.blocks.append(("fig", name, buf.getvalue(), caption))

    def raw(self, html_text: str, md_text: str) -> None:
        self.blocks.append(("html", html_text, md_text))

    def markdown(self, files: str) -> tuple[str, dict[str, bytes]]:
        out, images = [f"# {self.title}", ""], {}
        for b in self.blocks:
            if b[0] == "md":
                out += [b[1], ""]
            elif b[0] == "fig":
                images[b[1]] = b[2]
                out += [f"![{b[3]}]({files}/{b[1]})", "", f"*{b[3]}*", ""]
            else:
                out += [b[2], ""]
        return "\n".join(out), images

    def html(self) -> str:
        body = [f"<h1>{html.escape(self.title)}</h1>"]
        for b in self.blocks:
            if b[0] == "md":
                body.append(md_to_html(b[1]))
            elif b[0] == "fig":
                data = base64.b64encode(b[2]).decode()
                body.append(f'<figure><img alt="{html.escape(b[3])}" src="data:image/png;base64,{data}">'
                            f"<figcaption>{html.escape(b[3])}</figcaption></figure>")
            else:
                body.append(b[1])
        style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
                 "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
                 "text-align:right}th{background:#f3f3f3}td:first-child{text-align:left}img{max-width:100%}"
                 "figcaption{color:#555;font-size:.9em}.tok{white-space:pre-wrap;font-family:monospace;"
                 "line-height:1.7;margin:.2em 0}.tok span{border-radius:3px}.panels{display:grid;grid-template-columns:1fr 1fr;"
                 "gap:.6em}.panel{border:1px solid #ddd;border-radius:4px;padding:.4em;font-size:.85em}pre{background:#f7f7f7;padding:.5em;overflow:auto}")
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def md_to_html(text: str) -> str:
    """The little markdown the report writes: headings, tables, bullet lines, paragraphs, code."""
    out, table, in_code = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                table.append(cells)
            continue
        if table:
            head, *rows = table
            out.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in head) + "</tr>" +
                       "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows) + "</table>")
            table = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level + 1}>{html.escape(line.lstrip('#').strip())}</h{level + 1}>")
        elif line.startswith("- "):
            out.append(f"<p>&bull; {html.escape(line[2:])}</p>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    return "\n".join(out)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    return plt, MaxNLocator


# -- sections ---------------------------------------------------------------------------------------
def results_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from .comparison import _mean_std, metric_of, metric_title, user_table
    results = {spec: {s: json.loads((d / "results.json").read_text()) for s, d in by.items()} for spec, by in runs.items()}
    title = metric_title([r for by in results.values() for r in by.values()])
    rows = [f"| method | {title}: mean over users (std over seeds) | seeds | scored model |", "|---|---|---|---|"]
    for spec, by in results.items():
        rows.append(f"| {spec} | {_mean_std([metric_of(r)[1] for r in by.values()])} | {len(by)} | {scoring_rule(spec)} |")
    users = list(dict.fromkeys(u for by in results.values() for r in by.values() for u in r["per_user"]))
    cells = {spec: [_mean_std(xs) if (xs := [r["per_user"][u][metric_of(r)[0]] for r in by.values()
                                             if metric_of(r)[0] in r["per_user"].get(u, {})]) else "-" for u in users]
             for spec, by in results.items()}
    page.md("## Results\n\n" + "\n".join(rows) + "\n\nPer user (mean over seeds):\n\n" + user_table(cells, users))


def curves_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from .engines.server import task_score
    plt, MaxNLocator = _plt()
    data: dict[str, dict[str, dict[int, list[float]]]] = {}
    metric = None
    for spec, by in runs.items():
        for d in by.values():
            for r in _jsonl(d / "metrics.jsonl"):
                sc = task_score(r)
                if sc:
                    metric = sc[0]
                    data.setdefault(spec, {}).setdefault(r["user"], {}).setdefault(r["round"], []).append(sc[1])
    if not data:
        return
    rounds = {r for by in data.values() for u in by.values() for r in u}
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (spec, by_user) in enumerate(data.items()):
        pts = sorted((rnd, statistics.fmean(statistics.fmean(v[rnd]) for v in by_user.values() if rnd in v))
                     for rnd in rounds if any(rnd in v for v in by_user.values()))
        ax.plot(*zip(*pts), marker="o", color=COLORS[i % len(COLORS)], label=spec)
    ax.set_xlabel("round")
    ax.set_ylabel(metric.replace("_", " "))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    fig.tight_layout()
    page.md("## Learning curves")
    page.fig(fig, "curves.png", f"{metric.replace('_', ' ')} per evaluated round, mean over users and seeds")
    users = sorted({u for by in data.values() for u in by})
    if 1 < len(users) <= 8:
        cols = min(4, len(users))
        fig, axes = plt.subplots((len(users) + cols - 1) // cols, cols, figsize=(3.2 * cols, 2.6 * ((len(users) + cols - 1) // cols)),
                                 squeeze=False)
        for ax, user in zip(axes.flat, users):
            for i, (spec, by_user) in enumerate(data.items()):
                if user in by_user:
                    pts = sorted((rnd, statistics.fmean(v)) for rnd, v in by_user[user].items())
                    ax.plot(*zip(*pts), marker="o", ms=3, color=COLORS[i % len(COLORS)], label=spec)
            ax.set_title(user, fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in list(axes.flat)[len(users):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        page.fig(fig, "curves-per-user.png", "the same, one panel per user")


def gates_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    plt, MaxNLocator = _plt()
    drawn = False
    for spec, by in runs.items():
        d = by[min(by)]
        rows = [r for r in _jsonl(d / "metrics.jsonl") if "gates" in r]
        if not rows:
            continue
        if not drawn:
            page.md("## Expert scores over training\n\nMean gate of each expert (expert 0: the generalist where "
                    "the method has one) on a validation batch, per user, by round: averaged over layers "
                    "(lines) and per layer at the last round (heat map). CoMiGS Fig. 4 / 10.")
            drawn = True
        users = list(dict.fromkeys(r["user"] for r in rows))[:8]
        fig, axes = plt.subplots(2, len(users), figsize=(3 * len(users), 5.2), squeeze=False)
        for j, user in enumerate(users):
            mine = sorted((r["round"], r["gates"]) for r in rows if r["user"] == user)
            # FedAMoLE gives each module its own number of expert slots (eq. 21's K_c differs by
            # module): a slot's line averages the layers that have it, missing cells stay blank
            n = max(len(layer) for layer in mine[-1][1])
            for e in range(n):
                axes[0, j].plot([rnd for rnd, _ in mine],
                                [statistics.fmean(layer[e] for layer in g if len(layer) > e) for _, g in mine],
                                marker="o", ms=3, color=COLORS[e % len(COLORS)], label=f"expert {e}")
            axes[0, j].set_title(user, fontsize=9)
            axes[0, j].set_ylim(0, 1)
            axes[0, j].xaxis.set_major_locator(MaxNLocator(integer=True))
            last = [[layer[e] if len(layer) > e else float("nan") for layer in mine[-1][1]] for e in range(n)]
            im = axes[1, j].imshow(last, aspect="auto", vmin=0, vmax=1, cmap="viridis")
            axes[1, j].set_xlabel("layer")
            axes[1, j].set_ylabel("expert")
            axes[1, j].yaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0, 0].legend(fontsize=7)
        axes[0, 0].set_ylabel("mean gate")
        fig.colorbar(im, ax=axes[1, :].tolist(), shrink=0.8)
        page.fig(fig, f"gates-{_slug(spec)}.png", f"{spec}: mean gate per expert by round (top), per layer at the "
                                                  "last round (bottom)")


def routing_section(page: Page, runs: dict[str, dict[int, Path]], texts_per_user: int = 1, tokens: int = 48) -> None:
    """Token routing colour maps for every mixture method (top-1 expert of each token at the
    first, middle and last mixture layer), on the first ``tokens`` tokens of each user's test split."""
    import torch

    from .config import load_config
    from .data import load_corpus, make_user_data
    from .models import mixtures, routing_stats, set_record_stats
    from .personal import ExportError, rebuild, run_config
    blocks, n_experts = [], 1
    for spec, by in runs.items():
        d = by[min(by)]
        users = [r["user"] for r in _jsonl(d / "metrics.jsonl") if r["round"] == 1 and "gates" in r]
        if not users or not (d / "adapters").is_dir():
            continue
        cfg = load_config(str(run_config(d)))
        data = None
        for user in users[:4]:
            try:
                model, tok, _ = rebuild(d, user)
            except (ExportError, KeyError, ValueError):
                break
            layers = mixtures(model)
            if not layers:
                break
            if data is None:
                data = {u.name: u for u in make_user_data(load_corpus(cfg.corpus), tok, cfg.data)}
            picked = sorted({0, len(layers) // 2, len(layers) - 1})
            for domain, u in list(data.items())[:4]:
                ids = u.test[:tokens].long() if u.task == "lm" else u.test.sample(1, torch.Generator().manual_seed(0))[0][0, :tokens]
                set_record_stats(model, True)
                with torch.inference_mode():
                    model(input_ids=ids.reshape(1, -1))
                stats = routing_stats(model)
                set_record_stats(model, False)
                n_experts = max(n_experts, *(len(st["mean_gate"]) for st in stats))
                pieces = token_pieces(tok, ids.tolist())
                lines_h, lines_m = [], []
                for li in picked:
                    top1 = stats[li]["top1"].reshape(-1).tolist()
                    spans = "".join(f'<span style="background:{COLORS[e % len(COLORS)]}55" title="expert {e}">'
                                    f"{html.escape(p)}</span>" for p, e in zip(pieces, top1))
                    lines_h.append(f"<div class='tok'><small>layer {li}:</small> {spans}</div>")
                    lines_m.append(f"layer {li}: " + " ".join(f"{p.strip() or '_'}[{e}]" for p, e in zip(pieces, top1)))
                label = f"{spec}, user {user}'s model on {domain}'s text"
                blocks.append((f"<div class='panel'><b>{html.escape(label)}</b>{''.join(lines_h)}</div>",
                               f"**{label}**\n\n" + "\n\n".join(lines_m)))
    if blocks:
        legend = " ".join(f'<span style="background:{c}55;padding:0 4px">expert {i}</span>' for i, c in enumerate(COLORS[:n_experts]))
        page.md("## Token routing\n\nEach token of a test text, coloured by the expert its router ranks first "
                "(CoMiGS Fig. 3, 14-19); one panel per (user model, text domain) at the first, middle and last layer.")
        page.raw(f"<p>{legend}</p>", "Markdown: each token is followed by [its top-1 expert].")
        page.raw("<div class='panels'>" + "".join(h for h, _ in blocks) + "</div>", "\n\n".join(m for _, m in blocks))


def token_pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds (decoding prefixes), so a character split over byte-level tokens
    shows whole, at the token that completes it, instead of as replacement characters."""
    out, prev = [], ""
    for i in range(len(ids)):
        text = tok.decode(ids[:i + 1])
        if text.endswith("\ufffd"):  # an incomplete character: wait for the token that completes it
            out.append("")
            continue
        out.append(text[len(prev):])
        prev = text
    return out


def server_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    from .comparison import plot_assignment
    plt, MaxNLocator = _plt()
    for spec, by in runs.items():
        seed, d = min(by.items())
        rows = _jsonl(d / "server.jsonl")
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
            ax.legend(fontsize=6, ncol=3)
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
            loads = [r for r in _jsonl(by[min(by)] / "metrics.jsonl")
                     if r.get("evaluated_by") == "server" and r.get("expert_load")]
            if loads:
                last = [r for r in loads if r["round"] == loads[-1]["round"]]
                grid = [r["expert_load"] for r in last]
                fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(grid[0]), 0.8 + 0.4 * len(grid)))
                im = ax.imshow(grid, cmap="viridis", vmin=0, aspect="auto")
                ax.set_xticks(range(len(grid[0])), [f"expert {j}" for j in range(len(grid[0]))], fontsize=7)
                ax.set_yticks(range(len(last)), [r["user"] for r in last], fontsize=7)
                for i, row in enumerate(grid):
                    for j, v in enumerate(row):
                        top = max(max(r) for r in grid)  # dark cells (low load) get white text
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.5 * top else "k")
                fig.colorbar(im, ax=ax, fraction=0.05)
                fig.tight_layout()
                page.fig(fig, f"expert-load-{_slug(spec)}.png", f"{spec}: the global MoE's expert load per test "
                                                                 "domain (share of top-k routing slots, mean over layers)")
            if "domains" in first and "devices" in first:
                page.md("| device | model | cluster | dominant true domain |\n|---|---|---|---|\n" + "\n".join(
                    f"| client{i} | {m} | {c} | {true[i] if true else '-'} |"
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


def traffic_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    lines = ["| method | round | clients uploading | MB up (sum) | MB down (sum) | mean update norm | train s (max) | epsilon |",
             "|---|---|---|---|---|---|---|---|"]
    for spec, by in runs.items():
        rows = _jsonl(by[min(by)] / "metrics.jsonl")
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
            "(CoMiGS Table 3, FedAMoLE Table IV).\n\n" + "\n".join(lines))


def privacy_section(page: Page, runs: dict[str, dict[int, Path]]) -> None:
    for spec, by in runs.items():
        f = by[min(by)] / "privacy.md"
        if f.exists():
            text = f.read_text()
            head = text.split("## Upload listings")[0].replace("# What left each device", "## What left each device")
            page.md(head.strip() + f"\n\n(full tensor listings: `{f}`)")


def _slug(spec: str) -> str:
    from .specs import spec_dirname
    return spec_dirname(spec)


# -- the page ---------------------------------------------------------------------------------------
def write_report(path: Path, routing: bool = True) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into ``path`` (a run, compare or method folder)."""
    from .files import atomic_write
    path = Path(path)
    runs = find_runs(path)
    page = Page(f"comix report: {path.name}")
    page.md(f"Folder `{path}`; methods: {', '.join(runs)}; seeds: {sorted({s for by in runs.values() for s in by})}.")
    results_section(page, runs)
    curves_section(page, runs)
    gates_section(page, runs)
    if routing:
        routing_section(page, runs)
    server_section(page, runs)
    traffic_section(page, runs)
    privacy_section(page, runs)
    text, images = page.markdown("report-files")
    tmp = Path(tempfile.mkdtemp(dir=path, prefix=".report-files-"))
    try:
        for name, data in images.items():
            (tmp / name).write_bytes(data)
        shutil.rmtree(path / "report-files", ignore_errors=True)
        tmp.rename(path / "report-files")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write(path / "report.md", lambda p: Path(p).write_text(text))
    atomic_write(path / "report.html", lambda p: Path(p).write_text(page.html()))
    return path / "report.html", path / "report.md"
