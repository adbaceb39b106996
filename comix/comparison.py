"""Run a grid of methods x seeds, resumably, and summarise it like the papers.

Method specs (``hetlora:reg=0.05``) live in ``comix.specs``, running one spec in ``comix.runner``.

Layout: ``<run_dir>/seed<S>/<spec>/{metrics.jsonl,results.json,...}``; a finished run (its
``results.json`` exists) is skipped, an interrupted one resumes from its checkpoint. The summary
holds a Table 1/5-style table (CoMiGS) or Table I/II/III-style table (FedAMoLE): mean (std) over
seeds of the users' mean task metric (test perplexity; accuracy or Rouge-L of the last round =
MTAL), a per-user table (mean over seeds), learning curves of that metric vs iteration (CoMiGS
Fig. 9; FedAMoLE Fig. 5's MTA[t] when it is accuracy or Rouge-L) and per-user curves (Fig. 5-7).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .engines.server import task_score
from .specs import spec_dirname

TITLES = {"test_ppl": "Test perplexity", "test_answer_ppl": "Test answer perplexity", "test_acc": "Test accuracy (%)",
          "test_rouge_l": "Test Rouge-L (%)",
          "test_score": "Test task score (accuracy or Rouge-L, %)"}


def metric_of(result: dict) -> tuple[str, float]:
    """(metric key, mean over users) of a results.json (runs from before ``metric``: perplexity)."""
    return result.get("metric", "test_ppl"), result.get("mean", result.get("mean_test_ppl"))


def metric_title(results) -> str:
    keys = {metric_of(r)[0] for r in results}
    return TITLES[keys.pop()] if len(keys) == 1 else "Test metric"


def collect(run_dir: Path, specs: list[str], seeds: list[int]) -> dict[str, dict[int, dict]]:
    """spec -> seed -> results.json of every finished run."""
    out: dict[str, dict[int, dict]] = {}
    for spec in specs:
        for seed in seeds:
            f = run_dir / f"seed{seed}" / spec_dirname(spec) / "results.json"
            if f.exists():
                out.setdefault(spec, {})[seed] = json.loads(f.read_text())
    return out


def _mean_std(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2f} ({statistics.pstdev(xs):.2f})" if len(xs) > 1 else f"{xs[0]:.2f}"


MANY_USERS = 8  # beyond this a per-user table lists users as rows (data.splits.token_table summarises likewise)


def user_table(cells: dict[str, list[str]], users: list[str]) -> str:
    """Each method's cells, one per user: methods as rows and users as columns for a few users
    (CoMiGS's Table 1 layout), users as rows for many (1000 columns would not read)."""
    if len(users) <= MANY_USERS:
        rows = ["| method | " + " | ".join(users) + " |", "|" + "---|" * (len(users) + 1)]
        rows += [f"| {m} | " + " | ".join(c) + " |" for m, c in cells.items()]
    else:  # methods as columns: their short labels (a spec's options would widen every column)
        rows = ["| user | " + " | ".join(short_spec(m) for m in cells) + " |", "|" + "---|" * (len(cells) + 1)]
        rows += [f"| {u} | " + " | ".join(c[i] for c in cells.values()) + " |" for i, u in enumerate(users)]
    return "\n".join(rows)


def client_majority_accuracy(partition: dict) -> dict[str, float]:
    """Each classification client's trivial baseline: the test accuracy (%) of answering the label
    most frequent in its own training split, by client name."""
    out = {}
    for name, row in partition.items():
        train, test = row["train"].get("labels"), row["test"].get("labels")
        if not train or not test or not sum(test.values()):
            continue
        majority = max(train, key=lambda c: (train[c], c))
        out[name] = 100.0 * test[majority] / sum(test.values())
    return out


def majority_label_accuracy(partition: dict) -> float | None:
    """The trivial baseline of a classification partition: the mean over clients of
    ``client_majority_accuracy`` (None: no classification client)."""
    accs = client_majority_accuracy(partition)
    return statistics.fmean(accs.values()) if accs else None


def one_label_share(result: dict) -> float | None:
    """Share (%) of a run's clients whose model answered every test example with one label."""
    preds = [m["test_predicted"] for m in result["per_user"].values() if m.get("test_predicted")]
    return 100.0 * sum(sum(1 for v in p.values() if v) == 1 for p in preds) / len(preds) if preds else None


def trivial_baselines(run_dir: Path, results: dict[str, dict[int, dict]], seeds: list[int]) -> str:
    """For classification runs, the trivial baselines every trained model must beat before it is
    read: the clients' majority training label (per seed's partition) and, per method, the share
    of clients whose model predicts one label. Empty for other tasks."""
    majority = {}
    for seed in seeds:
        for folder in (run_dir / f"seed{seed}", run_dir):
            if (folder / "partition.json").exists():
                acc = majority_label_accuracy(json.loads((folder / "partition.json").read_text()))
                if acc is not None:
                    majority[seed] = acc
                break
    if not majority:
        return ""
    spread = " (population std over seeds)" if len(majority) > 1 else ""
    lines = [f"Trivial baselines (to beat before a row is read): each client answering its majority training label "
             f"scores {_mean_std(list(majority.values()))}{spread}; clients whose model answers every test example "
             "with one label, mean over seeds:", "",
             "| method | MTAL minus majority label | clients predicting one label (%) |", "|---|---|---|"]
    for spec, by_seed in results.items():
        gaps = [metric_of(r)[1] - majority[s] for s, r in by_seed.items() if s in majority]
        shares = [x for r in by_seed.values() if (x := one_label_share(r)) is not None]
        lines.append(f"| {spec} | {_mean_std(gaps) if gaps else '-'} | {_mean_std(shares) if shares else '-'} |")
    return "\n".join(lines)


def summary_tables(results: dict[str, dict[int, dict]], users: list[str]) -> str:
    """Table 1/5 (CoMiGS) or I/II/III (FedAMoLE) style: mean (std) over seeds of the users' mean
    test metric (of the last round: MTAL for accuracy / Rouge-L), and a per-user table."""
    title = metric_title([r for by in results.values() for r in by.values()]).lower()
    label = f"MTAL: {title}" if "ppl" not in title and "perplexity" not in title else f"mean {title}"
    lines = [f"| method | {label} (population std over seeds) | seeds |", "|---|---|---|"]
    for spec, by_seed in results.items():
        lines.append(f"| {spec} | {_mean_std([metric_of(r)[1] for r in by_seed.values()])} | {len(by_seed)} |")
    cells = {spec: [_mean_std(xs) if (xs := [r["per_user"][u][metric_of(r)[0]] for r in by_seed.values()
                                             if metric_of(r)[0] in r["per_user"].get(u, {})]) else "-"
                    for u in users]
             for spec, by_seed in results.items()}
    return "\n".join(lines + ["", user_table(cells, users)])


def curves(run_dir: Path, specs: list[str], seeds: list[int]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """spec -> user -> [(iteration, task metric mean over seeds)] from metrics.jsonl."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for spec in specs:
        points: dict[tuple[str, int], list[float]] = {}
        for seed in seeds:
            f = run_dir / f"seed{seed}" / spec_dirname(spec) / "metrics.jsonl"
            if not f.exists():
                continue
            for line in f.read_text().splitlines():
                row = json.loads(line)
                if score := task_score(row):
                    it = row.get("iteration", row["round"])  # runs older than the "iteration" field: rounds
                    points.setdefault((row["user"], it), []).append(score[1])
        for (user, it), v in sorted(points.items(), key=lambda kv: kv[0][1]):
            out.setdefault(spec, {}).setdefault(user, []).append((it, statistics.fmean(v)))
    return out


def references(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, float]]:
    """Untrained methods (Pretrained): spec -> user -> test metric, drawn as horizontal lines."""
    return {spec: {u: statistics.fmean(task_score(r["per_user"][u])[1] for r in by.values())
                   for u in next(iter(by.values()))["per_user"]}
            for spec, by in results.items() if by and all(r["rounds"] == 0 for r in by.values())}


def privacy_table(results: dict[str, dict[int, dict]]) -> str:
    """Utility against privacy: per spec run with ``privacy.*``, its clip, noise
    multiplier, epsilon at its delta after the last round and the task metric (mean (std) over
    seeds); empty when no run was private."""
    private = {spec.split(":")[0] for spec, by in results.items() if any("privacy" in r for r in by.values())}
    if not private:
        return ""
    rows, deltas = [], set()
    for spec, by_seed in results.items():
        if spec.split(":")[0] not in private:
            continue
        first = next(iter(by_seed.values()))
        p, eps = first.get("privacy"), first.get("epsilon")
        if p and eps is not None:
            deltas.add(p["delta"])
        where = "inf (no noise)" if eps is None else f"{eps:.3g}"
        rows.append(f"| {short_spec(spec)} | {p['clip']:g} | {p['noise_multiplier']:g} | {where} | " if p else
                    f"| {short_spec(spec)} | - | - | inf (no DP) | ")
        rows[-1] += f"{_mean_std([metric_of(r)[1] for r in by_seed.values()])} |"
    title = metric_title([r for by in results.values() for r in by.values()])
    at = f" (delta {', '.join(f'{d:g}' for d in sorted(deltas))})" if deltas else ""
    return "\n".join([f"| method | clip | noise multiplier | epsilon{at} | {title} (population std over seeds) |",
                      "|---|---|---|---|---|", *rows])


SHORT_KEYS = {"noise_multiplier": "sigma", "target_epsilon": "epsilon"}


def short_spec(spec: str) -> str:
    """A method spec as a column or row label reads: the method, then each option's last key part
    (``fedavg:privacy.clip=0.3,privacy.noise_multiplier=1`` -> ``fedavg clip=0.3 sigma=1``)."""
    name, _, options = spec.partition(":")
    if not options:
        return name
    from .config import split_outside_brackets
    parts = []
    for item in split_outside_brackets(options):
        key, _, value = item.partition("=")
        key = key.split(".")[-1]
        parts.append(f"{SHORT_KEYS.get(key, key)}={value}")
    return f"{name} {' '.join(parts)}"


def _jsonl(path: Path) -> list[dict]:
    """The records of a jsonl file, or of its xz-compressed copy (bench/results keeps logs so)."""
    if not path.exists() and path.with_name(path.name + ".xz").exists():
        import lzma
        with lzma.open(path.with_name(path.name + ".xz"), "rt") as fh:
            return [json.loads(ln) for ln in fh.read().splitlines()]
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def overhead_table(run_dir: Path, specs: list[str], seeds: list[int]) -> str:
    """FedAMoLE Table IV: per client and round, mean over rounds, the clients that trained and
    seeds: trainable state (parameters + gradients + AdamW moments, fp32), peak device memory
    (CUDA runs only), MB uploaded / downloaded, training, aggregation (RSEA included, as the
    paper counts it), RSEA alone and testing latency. Aggregation and RSEA are the server's time
    per round; testing is a client's evaluation (MTA's Rouge-L / accuracy)."""
    cols = ("trainable_mb", "peak_mem_mb", "up_mb", "down_mb", "train_s", "aggregate_s", "rsea_s", "eval_s")
    lines = ["| method | trainable state (MB) | peak memory (MB, CUDA) | upload (MB) | download (MB) | train (s) "
             "| aggregation (s) | of which RSEA (s) | test (s) |", "|---|" + "---|" * len(cols)]
    for spec in specs:
        got: dict[str, list[float]] = {c: [] for c in cols}
        for seed in seeds:
            d = run_dir / f"seed{seed}" / spec_dirname(spec)
            for row in _jsonl(d / "metrics.jsonl"):
                if row.get("sampled", True) and "train_s" in row:
                    for c in ("trainable_mb", "peak_mem_mb", "train_s"):
                        if c in row:
                            got[c].append(row[c])
                    got["up_mb"].append(row["bytes_up"] / 2**20)
                    got["down_mb"].append(row["bytes_down"] / 2**20)
                if "eval_s" in row:
                    got["eval_s"].append(row["eval_s"])
            for row in _jsonl(d / "server.jsonl"):
                for c in ("aggregate_s", "rsea_s"):
                    if c in row:
                        got[c].append(row[c])
        if got["train_s"]:
            lines.append(f"| {spec} | " + " | ".join(f"{statistics.fmean(got[c]):.3g}" if got[c] else "-"
                                                      for c in cols) + " |")
    return "\n".join(lines)


def global_model_tables(run_dir: Path, results: dict[str, dict[int, dict]], specs: list[str], seeds: list[int]) -> str:
    """DeepFusion Tables I-II, Fig. 7-8 for methods whose server scored a global model: the answer
    and the stream perplexity (log), the token accuracy of generated answers (%, on question-answer data)
    and the teacher-forced token accuracy per test domain and mean, mean (std) over seeds,
    with the dense base before distillation as a row; total upload (MB, Fig. 8) and each device
    model's training state (parameters + gradients + AdamW moments, fp32 MB; Fig. 7's on-device
    memory). Empty when no method scored a global model."""
    scored = _global_scored(results)
    if not scored:
        return ""
    domains = sorted({d for by in scored.values() for r in by.values() for d in r["per_user"]})
    out = []
    tables = (("answer_log_ppl", "Answer perplexity (log): the answers' tokens given their questions, lower is "
                                 "better (Table I, the paper's)"),
              ("log_ppl", "Stream perplexity (log): every token of the test text, questions included"),
              ("answer_acc", "Token accuracy of generated answers (%, Table II)"),
              ("token_acc", "Teacher-forced next-token accuracy over the test text (%)"))
    for key, title in tables:
        if not any(f"test_{key}" in v for by in scored.values() for r in by.values() for v in r["per_user"].values()):
            continue  # no question-answer data: no generated answers
        lines = [f"{title}", "", "| method | " + " | ".join(domains) + " | mean |", "|" + "---|" * (len(domains) + 2)]
        rows = [(spec, by, f"test_{key}") for spec, by in scored.items()]
        first = next(iter(scored.items()))
        rows.append((f"dense base ({first[0]} run)", first[1], f"test_base_{key}"))
        for label, by, k in rows:  # "-": a domain without that score (no question-answer data)
            cells = [(lambda xs: _mean_std(xs) if xs else "-")([r["per_user"][d][k] for r in by.values()
                                                                  if k in r["per_user"].get(d, {})]) for d in domains]
            means = [statistics.fmean(r["per_user"][d][k] for d in domains if k in r["per_user"].get(d, {}))
                     for r in by.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_mean_std(means)} |")
        out.append("\n".join(lines))
    lines = ["Communication and device memory", "", "| method | total upload (MB) | device model: training state (MB) |",
             "|---|---|---|"]
    for spec, by in scored.items():
        memory = _device_memory(run_dir, spec, seeds)
        up = _mean_std([r["bytes_up_total"] / 2**20 for r in by.values()])
        lines.append(f"| {spec} | {up} | " + ", ".join(f"{m}: {v:.1f}" for m, v in sorted(memory.items())) + " |")
    out.append("\n".join(lines))
    return "\n\n".join(out)


def _global_scored(results: dict[str, dict[int, dict]]) -> dict[str, dict[int, dict]]:
    """The methods whose server scored a global model (DeepFusion and its baselines)."""
    return {s: by for s, by in results.items() if any("test_log_ppl" in v for r in by.values()
                                                      for v in r["per_user"].values())}


def _device_memory(run_dir: Path, spec: str, seeds: list[int]) -> dict[str, float]:
    """Device model -> its training state (MB) as the devices of ``spec``'s runs logged it."""
    memory: dict[str, float] = {}
    for seed in seeds:
        for row in _jsonl(run_dir / f"seed{seed}" / spec_dirname(spec) / "metrics.jsonl"):
            if "device_model" in row:
                memory[row["device_model"]] = row["trainable_mb"]
    return memory


def assignment_churn(rows: list[dict]) -> list[float]:
    """Per round after the first, the share of the domain experts a client trained that it had
    not trained the round before (mean over clients and modules), read from the upload listings
    in server.jsonl (an expert's tensors name its global id: ``...experts.<id>.lora_A``). FedMoLE
    keeps round 1's assignment (0 after it); FedAMoLE re-solves every round."""
    import re
    listings = {sig: lst for r in rows for sig, lst in r.get("signatures", {}).items()}
    held = []  # per round: {client: {module: set of expert ids}}
    for r in rows:
        per_client = {}
        for c, up in r.get("uploads", {}).items():
            mods: dict[str, set] = {}
            for name, *_ in listings.get(up["sig"], []):
                m = re.match(r"(.+)\.experts\.(\d+)\.lora_A$", name)
                if m:
                    mods.setdefault(m.group(1), set()).add(int(m.group(2)))
            per_client[c] = mods
        held.append(per_client)
    out = []
    for prev, now in zip(held, held[1:]):
        shares = [len(ids - prev[c].get(mod, set())) / len(ids) for c, mods in now.items() if c in prev
                  for mod, ids in mods.items() if ids]
        out.append(statistics.fmean(shares) if shares else float("nan"))
    return out
