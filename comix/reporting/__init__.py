"""`comix report DIR`: one page a person would rather look at than read.

``DIR`` is a run folder (``<run>/<method>/``), a compare folder (``<run>/seed<S>/<method>/``) or one
method folder. The page is built from what the records hold, a section per *kind of record*, so a
method gets every section its records allow:
  results.json ............ results: mean (std) over seeds, per-user table, each method's scoring rule,
                            epsilon and utility against epsilon when DP was on (sections.py)
  metrics.jsonl ........... learning curves (task metric per evaluated round, per method and user; a
                            bar chart when only one round was evaluated), training loss per round,
                            the std over seeds as bands (curves.py);
                            communication and compute (bytes up / down, update norm, time per round);
                            what each device spent: its training memory, uploads, tokens, drops (devices.py)
  metrics.jsonl "gates" ... expert scores over training (CoMiGS Fig. 4 / 10: mean gate per expert
                            and layer, per user, by round)
  adapters + a mixture .... token routing colour maps (CoMiGS Fig. 3, 14-19): test texts of each
                            user, every token coloured by its top-1 expert at the first, middle
                            and last layer (rebuilt with ``personal.rebuild``)
  server.jsonl ............ FedAMoLE's assignment view (Fig. 8) and solve times; DeepFusion's KD
                            loss terms per step and its clusters; epsilon per round
  privacy.md .............. what left each device
Every table and figure names a method by its short name (``comparison.short_spec``; a table at the
top maps each to its spec) and draws it in one colour (``page.method_styles``); every figure is
checked for overlapping tick labels, text too small at the page's width and legends over data.
Writes ``report.html`` (self-contained: images inline as data URIs, no network) and ``report.md``
(the same content, its images under ``report-files/``), each through a temp file and a rename.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .page import Page, md_to_html, overlapping_tick_labels
from .records import ReportError, find_runs, scoring_rule
from .routing import routing_section, token_pieces
from .devices import devices_section
from .curves import curves_section
from .sections import gates_section, privacy_section, results_section, traffic_section
from .server import server_section


def build_page(path: Path, routing: bool = True) -> Page:
    """The report of ``path`` (a run, compare or method folder) as a Page, not yet written."""
    from ..comparison import short_spec
    runs = find_runs(path)
    page = Page(f"comix report: {path.name}", runs)
    seeds = sorted({s for by in runs.values() for s in by})
    page.md(f"Folder `{path}`; methods: {', '.join(map(short_spec, runs))}; seeds: {seeds}.")
    setup = setup_line(path)
    if setup:
        page.md(setup)
    if any(short_spec(s) != s for s in runs):  # every table and figure names a method by its short name
        page.md("Methods by the short name every table and figure gives them:\n\n| short name | method spec |\n|---|---|\n"
                + "\n".join(f"| {short_spec(s)} | `{s}` |" for s in runs if short_spec(s) != s))
    results_section(page, runs)
    curves_section(page, runs)
    gates_section(page, runs)
    if routing:
        routing_section(page, runs)
    server_section(page, runs)
    traffic_section(page, runs)
    devices_section(page, runs)
    privacy_section(page, runs)
    return page


def setup_line(path: Path) -> str:
    """What the run was, from its config.yaml (the folder's, or its run's above a method folder):
    model, corpus, data split, rounds, steps and batch; a plain warning when the model is one of
    the random tiny test models, whose numbers say that the code runs, not how a method does."""
    import yaml

    from ..models.base import TINY
    for folder in (path, path.parent, path.parent.parent):
        if (folder / "config.yaml").exists():
            cfg = yaml.safe_load((folder / "config.yaml").read_text()) or {}
            break
    else:
        return ""
    data, train = cfg.get("data") or {}, cfg.get("train") or {}
    if data.get("clients"):
        split = f"{data['clients']} clients, " + (f"partition {data.get('partition')}" if data.get("partition") == "task"
                                                  else f"Dirichlet({data.get('alpha')})")
    else:
        split = f"users' own categories, mode {data.get('mode', 'in')}"
    split += ", each seed its own data split" if data.get("seed") == "run" else \
        f", each seed its own data split (data seeds {data['seed']})" if isinstance(data.get("seed"), dict) else \
        f", data.seed {data.get('seed', 0)}"
    line = (f"**Setup**: model `{cfg.get('model')}`, corpus `{cfg.get('corpus')}` ({split}); "
            f"{train.get('rounds')} rounds x {train.get('local_steps')} local steps of batch {train.get('batch_size')}"
            f" (sequences of {train.get('seq_len')} tokens); precision {cfg.get('precision', 'fp32')}.")
    if cfg.get("model") in TINY:
        line += (f" **Warning**: `{cfg.get('model')}` is a tiny model with random weights, for tests and quick "
                 "tries: its perplexities say that the code runs, not how a method does.")
    return line


def write_report(path: Path, routing: bool = True) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into ``path`` (a run, compare or method folder)."""
    from ..files import atomic_write
    path = Path(path)
    page = build_page(path, routing)
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


__all__ = ["Page", "ReportError", "build_page", "find_runs", "gates_section", "md_to_html", "overlapping_tick_labels",
           "routing_section", "scoring_rule", "token_pieces", "write_report"]
