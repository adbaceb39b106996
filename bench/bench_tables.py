"""Tables of a bench's own result file (``BENCH_FILES``: what bench/layer_speed.py, bench/cohort.py,
bench/soak.py ... write) or folder of whole runs (``BENCH_DIRS``), not of a case."""
from __future__ import annotations

import json
import lzma
import re
import statistics
from pathlib import Path


def layer_speed_table(text: str) -> str:
    """bench/layer_speed.py's result file: per model, the mixture's training step over one plain
    LoRA's (run 1 / run 2, compiled and eager), then per MLP block compiled / eager / naive (run 1)."""
    rows, sections = [], re.findall(r"^(\S.*?): one LoRA r=\d+.*\n((?:    n=.*\n?)+)", text, re.M)
    shape = re.search(r"whole model (\d+)x(\d+)", text) or re.search(r"batch (\d+)x(\d+)", text)
    block = re.search(r"blocks (\d+)x(\d+)", text) or shape
    ns = sorted({int(n) for _, lines in sections for n in re.findall(r"n=(\d+)", lines)})
    ratio = {(name, int(n), kind): (float(a), float(b)) for name, lines in sections
             for n, kind, a, b in re.findall(r"n=(\d+) (\w+)\s+/ LoRA: ([\d.]+)\s+([\d.]+)", lines)}
    for name, _ in sections:
        if name.endswith("step"):
            label = name.replace("GPT-2-124M", "GPT-2-124M shapes")
            for kind, shown in (("compiled", "compiled"), ("fused", "eager")):
                cells = [" / ".join(f"{x:.2f}" for x in ratio[name, n, kind]) if (name, n, kind) in ratio else ""
                         for n in ns]
                rows.append(f"| {label} ({shape[1]} x {shape[2]}), {shown} | " + " | ".join(cells) + " |")
    for name, _ in sections:
        if name.endswith("block"):
            cells = [" / ".join(f"{ratio[name, n, k][0]:.2f}" for k in ("compiled", "fused", "naive"))
                     if (name, n, "naive") in ratio else "" for n in ns]
            rows.append(f"| {name.replace(' block', ' MLP block')} ({block[1]} x {block[2]} rows), compiled / eager / "
                        "naive (run 1) | " + " | ".join(cells) + " |")
    return "\n".join(["| | " + " | ".join(f"n = {n}" for n in ns) + " |", "|---" * (len(ns) + 1) + "|", *rows])


def vaa_attribution_table(text: str) -> str:
    """bench/vaa_attribution.py's result file: per run (alpha, VAA's lr, VAA's warm-up steps), the
    feature loss FM at the first and last joint step; the sums over the steps of each step's change
    in FM on its batch made by the student's update (VAA held at its weights before the step), by
    VAA's (the student held), by both, and of CE's change on the batch by the student's update (and
    the student's share in the first and the last quarter of the steps); on
    the held-out batches, FM under the final VAA with the final student minus with the starting
    one (what the student's moves left), and CE's change."""
    r = json.loads(text)
    rows = []
    for run in r["runs"].values():
        steps, held = run["steps"], run["held_out"]
        total = {k: sum(s[k] for s in steps) for k in ("fm_by_student", "fm_by_vaa", "fm_by_both", "ce_by_student")}
        q = max(1, len(steps) // 4)  # does the student's part grow as VAA settles? its share early and late
        share = [sum(s["fm_by_student"] for s in part) / sum(s["fm_by_both"] for s in part)
                 for part in (steps[:q], steps[-q:])]
        rows.append(f"| {run['alpha']:g} | {run['feature_lr']:g} | {run['warmup']} | {steps[0]['fm']:.3f} / "
                    f"{steps[-1]['fm']:.3f} | {total['fm_by_student']:+.4f} | {total['fm_by_vaa']:+.4f} | "
                    f"{total['fm_by_both']:+.4f} | {total['fm_by_student'] / total['fm_by_both']:.1%} | "
                    f"{share[0]:.1%} / {share[1]:.1%} | "
                    f"{total['ce_by_student']:+.4f} | {held['fm_final'] - held['fm_start_student']:+.4f} | "
                    f"{held['ce_final'] - held['ce_start']:+.4f} |")
    return "\n".join([f"Teacher {r['spec']} (device cache file {r['teacher'][:12]}...), {r['steps']} joint KD steps a run "
                      f"from the same start and batches, seed {r['seed']}; {r['machine']}, {r['date']}, "
                      f"{r['seconds'] / 60:.0f} min.", "",
                      "| alpha | VAA's lr | VAA's warm-up steps | FM, first / last joint step | FM's change by the "
                      "student's updates (sum over the steps) | by VAA's updates | by both | the student's share | "
                      "its share, first / last quarter of the steps | "
                      "CE's change on the batch by the student's updates (sum) | held out: FM with the final student "
                      "minus with the starting one (final VAA) | held out: CE's change |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])


def cohort_table(text: str) -> str:
    """bench/cohort.py's result file: per adapter kind and cohort size, the step's time, training
    tokens/s (and over cohort 1's), FLOPs counted a step, the share of the measured GEMM rate (and of
    the card's nominal peak on CUDA), the mixture's step over plain LoRA's at that cohort size, and memory."""
    r = json.loads(text)
    nominal = r.get("nominal_peak_flops")
    cuda = r["device"] == "cuda"
    head = ["adapters", "cohort", "step (ms)", "tokens/s", "x cohort 1", "GFLOP a step", "MFU of the GEMM rate",
            *(["MFU of nominal peak"] if nominal else []), "mixture / LoRA step",
            "peak GPU memory (MB)" if cuda else "step peak (MB)" if "step_peak_mb" in r["results"][0] else "activations kept (MB)"]
    rows = []
    for x in r["results"]:
        step = " (CUDA graph)" if x.get("graph") else " (eager)" if cuda and x["cohort"] > 1 and "graph" in x else ""
        rows.append([x["adapters"], f"{x['cohort']}{step}", f"{x['step_s'] * 1e3:.1f}", f"{x['tokens_per_s']:,.0f}",
                     f"{x.get('speedup_tokens_per_s', 1.0):.2f}", f"{x['flops'] / 1e9:,.0f}", f"{x['mfu_gemm']:.1%}",
                     *([f"{x['mfu_nominal']:.1%}"] if nominal else []),
                     f"{x['step_over_lora']:.2f}" if "step_over_lora" in x else "",
                     f"{x['peak_mem_mb']:,.0f}" if cuda else f"{x.get('step_peak_mb', x.get('activation_mb')):,.0f}"])
    gemm = f"{r['gemm_peak_flops'] / 1e12:.2f} TFLOP/s" if r["gemm_peak_flops"] >= 1e12 else \
        f"{r['gemm_peak_flops'] / 1e9:.0f} GFLOP/s"
    return "\n".join([f"`{r['command']}`: {r['model']}, {r['precision']}, {r['rows']} x {r['seq']} tokens a client, "
                      f"median of {r['reps']} interleaved steps; {r['machine']}, torch {r['torch']}, {r['date']}; "
                      f"the GEMM rate measured there: {gemm}; the bench took {r['seconds'] / 60:.1f} min, peak RSS "
                      f"{r['peak_rss_mb'] / 1024:.1f} GB.", "",
                      "| " + " | ".join(head) + " |", "|---" * len(head) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


def cohort_runs_table(folder: Path) -> str:
    """bench/results/<folder>/: whole runs one client at a time and in cohorts, each a subfolder
    with /usr/bin/time -v's lines (time.txt) and per method its server.jsonl (xz): wall time, peak
    RSS, the rounds' training seconds and the evaluations' seconds summed over the methods."""
    rows = []
    for run in sorted(p for p in folder.iterdir() if p.is_dir()):
        timing = (run / "time.txt").read_text()
        command = re.search(r'Command being timed: "(.*)"', timing)[1]
        command = re.sub(r"\S*/(comix|configs)", r"\1", command.replace(" run_dir=/tmp/" + run.name.replace("-", "/"), ""))
        command = re.sub(r" run_dir=\S+", "", command)
        h, m, sec = ([0] + [float(x) for x in re.search(r"Elapsed.*: ([\d:.]+)", timing)[1].split(":")])[-3:]
        peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timing)[1]) / 2**20
        server = [json.loads(ln) for f in sorted(run.glob("*.server.jsonl.xz"))
                  for ln in lzma.open(f, "rt").read().splitlines()]
        train = sum(r.get("train_s", 0) for r in server)
        evals = sum(r.get("eval_s", 0) for r in server)
        rows.append(f"| `{command}` | {(h * 60 + m) * 60 + sec:.1f} | {peak:.1f} | {train:.2f} | {evals:.2f} |")
    return "\n".join(["| command | wall (s) | peak RSS (GB) | training, summed over rounds and methods (s) | "
                      "evaluation (s) |", "|---|---:|---:|---:|---:|", *rows])


BENCH_DIRS = {"cohort-cpu-runs": cohort_runs_table}  # a bench folder of whole runs, not a case


def device_export_table(text: str) -> str:
    """bench/device_export.py's result file: per user model, format and precision, the file's size,
    perplexity on the user's test split (and llama.cpp's, where it ran) against comix's own model,
    greedy tokens/s on the CPU and whether the greedy tokens equal comix's."""
    r = json.loads(text)
    rows = []
    for x in r["rows"]:
        size = "-" if x["file_bytes"] is None else f"{x['file_bytes'] / 1e6:,.1f}"
        ppl = f"{x['ppl']:.3f} ({100 * x['ppl_vs_comix']:+.2f} %)"
        if "llama_cpp_ppl" in x:
            ppl += f"; llama.cpp {x['llama_cpp_ppl']:.3f}"
        speed = f"{x['tokens_per_s']:.1f}" if "tokens_per_s" in x else "-"
        same = {True: "yes", False: "no"}.get(x.get("greedy_equals_comix"), "-") if x["format"] != "comix" else ""
        export = f"{x['export_s']:.0f}" if "export_s" in x else "-"
        where = {"comix": "PyTorch (comix)", "executorch": f"ExecuTorch, XNNPACK {x.get('xnnpack') or ''}".strip(),
                 "gguf": "GGUF" + (" (llama.cpp)" if "llama_cpp_ppl" in x else " (transformers' reader)")}[x["format"]]
        rows.append(f"| {x['method']} | {where} | {x['precision']} | {size} | {ppl} | {speed} | {same} | {export} |")
    llama = f", llama-cpp-python {r['llama_cpp']}" if r.get("llama_cpp") else ", llama.cpp not installed"
    return "\n".join([f"`{r['command'].strip()}`: {r['base']}, user {r['user']}, perplexity over the test split in "
                      f"windows of {r['seq_len']} tokens, {r['new_tokens']} greedy tokens after 32 (median of 3 "
                      f"after a warm-up); {r['machine']}, {r['date']}, torch {r['torch']}, executorch "
                      f"{r['executorch']}{llama}; the bench took {r['seconds'] / 60:.1f} min, peak RSS "
                      f"{r['peak_rss_mb'] / 1024:.1f} GB.", "",
                      "| user model | runtime | precision | file (MB) | perplexity (vs comix) | tokens/s | "
                      "greedy tokens = comix's | export (s) |",
                      "|---|---|---|---:|---:|---:|---|---:|", *rows])


def soak_table(text: str) -> str:
    """bench/soak.py's result file: what a TLS + authenticated loopback deployment went through
    (faults injected and left out, by kind; restarts) and what held (rounds complete, aggregates
    equal to the in-process replay), with the server's memory and the wall time against the
    undisturbed run."""
    r = json.loads(text)
    faults = " ".join(f"{k} {f['left_out']}/{f['injected']}" for k, f in r["faults"].items())
    calm = f"{r['undisturbed_wall_s'] / 60:.1f} min" if "undisturbed_wall_s" in r else "not run"
    held = "none" if not r["problems"] else "; ".join(r["problems"])
    rows = [("SuperNodes x rounds", f"{r['nodes']} x {r['rounds']} (round timeout {r['timeout_s']:g} s)"),
            ("rounds completed, every device logged", f"{r['rounds_completed']} of {r['rounds']}"),
            ("faults left out of the aggregate / injected", faults),
            ("rounds a restarting device missed (not planned)", str(r["collateral_misses"])),
            ("SuperNodes restarted; ServerApp killed and resubmitted", f"{r['device_restarts']}; {r['server_kills']} "
             f"(in round {r.get('killed_in_round', '-')})"),
            ("aggregates equal to the in-process replay", f"{r['aggregates_equal_to_replay']} of {r['rounds']} "
             f"(worst relative difference {r['worst_fingerprint_rel_diff']:.2g}; final perplexities "
             f"{r['final_test_ppl_rel_diff']:.2g})"),
            ("peak RSS: ServerApp, SuperLink", f"{r['serverapp_peak_rss_mb']:.0f} MB, {r['superlink_peak_rss_mb']:.0f} MB"),
            ("wall time: soak, undisturbed run", f"{r['wall_s'] / 60:.1f} min, {calm}"),
            ("problems found", held)]
    note = f" Note: {r['note']}." if r.get("note") else ""
    return "\n".join([f"`{r['command'].strip()}` (seed {r['seed']}): {r['machine']}, {r['date']}, torch {r['torch']}, "
                      f"flwr {r['flwr']}.{note}", "", "| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def poisoned_table(text: str) -> str:
    """bench/poisoned.py's result file: the honest clients' mean test perplexity of FedAvg's global
    model under each server rule, without attack and under each attack, mean over seeds and per seed,
    each attacked run's difference from the clean mean run with a 95 % t interval over the seeds;
    read only where the clean run's gain over the untrained base is itself resolved (the first line)."""
    from cases import paired_interval
    r = json.loads(text)
    table, seeds = r["honest_test_ppl"], r["seeds"]
    clean = table["none"]["mean"]

    def num(x, sign=""):  # a diverged model's perplexity in powers of ten
        return f"{x:{sign}.3g}" if abs(x) >= 1e5 else f"{x:{sign}.2f}"

    def cell(xs):
        per = " / ".join(num(x) for x in xs)
        return f"{num(statistics.fmean(xs))} ({per})" if len(xs) > 1 else per

    def diff(xs):
        mean, half = paired_interval([x - c for x, c in zip(xs, clean)])
        return num(mean, "+") if half != half else f"{num(mean, '+')} [{num(mean - half, '+')}, {num(mean + half, '+')}]"
    gain, half = paired_interval([u - c for u, c in zip(r["pretrained_honest_test_ppl"], clean)])
    resolved = half == half and gain - half > 0
    head = (f"`{r['command'].strip()}`: {r['clients']} clients, clients {', '.join(map(str, r['attackers']))} attack "
            f"every round; seeds {' / '.join(map(str, seeds))}; {r['machine']}, {r['date']}, torch {r['torch']}. "
            f"The untrained base scores {cell(r['pretrained_honest_test_ppl'])} on the honest clients, the clean "
            f"mean run {cell(clean)}: a gain of {gain:.2f}" + ("" if half != half else f" [{gain - half:.2f}, {gain + half:.2f}]")
            + (", resolved over the seeds, so the rules can be read." if resolved else
               " on one seed: directions only, no difference resolved." if half != half else
               ", not resolved over the seeds: the rules cannot be read at this scale yet."))
    attacks = list(table)
    rows = [f"| {rule} | " + " | ".join(cell(table[a][rule]) + ("" if a == "none" and rule == "mean" else
                                                                 f"; {diff(table[a][rule])}") for a in attacks) + " |"
            for rule in table["none"]]
    return "\n".join([head, "", "| server rule | " + " | ".join(
        f"{'no attack' if a == 'none' else a}: honest test ppl (per seed); minus the clean mean run" for a in attacks) + " |",
        "|---|" + "---|" * len(attacks), *rows])


def language_shift_scale_table(text: str) -> str:
    """bench/language_shift_scale.py's file: per scale (k x the small schedule's expert iterations)
    Local's and CoMiGS-1G1S's mean test perplexity, CoMiGS's lead over Local with its 95 % t interval
    over seeds, and the router's own signals. A scale is read only where both models' gains over the
    untrained base are resolved (the results page's rule); one seed reads in direction only."""
    from cases import paired_interval
    r = json.loads(text)

    def cell(xs):
        return f"{statistics.fmean(xs):.2f} ({' / '.join(f'{x:.2f}' for x in xs)})" if len(xs) > 1 else f"{xs[0]:.2f}"

    def verdict(base, ppl, mean, half):
        if base is None:
            return "a rehearsal: no base to read against"
        gains = {m: paired_interval([b - p for b, p in zip(base, ppl[m])]) for m in ppl}
        if any(h != h for _, h in gains.values()):
            return "one seed: direction only"
        names = {"local": "Local", "comigs-1g1s": "CoMiGS-1G1S"}
        behind = [names[m] for m, (g, h) in gains.items() if g + h < 0]
        if behind:  # trained into overfitting: worse than no training at all, resolved
            return f"not testable ({' and '.join(behind)} behind the untrained base)"
        if any(g - h <= 0 for g, h in gains.values()):
            return "not testable (a model's gain over the untrained base is not resolved)"
        if abs(mean) <= half:
            return "unresolved"
        return "CoMiGS-1G1S ahead" if mean > 0 else "Local ahead"
    rows = ["| scale | rounds x local steps | seeds | untrained base | Local test ppl (per seed) | CoMiGS-1G1S test ppl (per seed) | "
            "CoMiGS-1G1S's lead over Local [95 % t] | reading | router valid CE, first -> last round | "
            "gate entropy per layer, first / mid / last (nats; even mix 0.693) | generalist's share |",
            "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, x in r["scales"].items():
        lead = x["comigs_lead_over_local"]
        mean, half = lead["mean"], lead["half_width_95"]
        ci = f"{mean:+.2f}" if half != half else f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]"
        # perplexity falls as training grows: the lead as a share of Local's says whether the gap closes
        ci += f" ({mean / statistics.fmean(x['test_ppl']['local']):+.1%} of Local's)"
        ent, loss = x["gate_entropy"], x["router_valid_loss"]
        base = x["pretrained_test_ppl"]
        sched = " x ".join(map(str, x["rounds_x_local_steps"]))
        if cut := x.get("train_tokens_per_user"):  # the train split cut so the schedule reads it several times
            sched += f" on {cut:,} train tokens a user ({x['passes']:g} pass{'' if x['passes'] == 1 else 'es'})"
        elif read := x.get("passes_read"):  # the case's own splits: how far the schedule reads into them
            sched += f" ({read[0]:.1%} to {read[1]:.1%} of a pass)"
        rows.append(f"| {name} | {sched} | {' / '.join(map(str, x['seeds']))} | "
                    f"{'-' if base is None else cell(base)} | {cell(x['test_ppl']['local'])} | "
                    f"{cell(x['test_ppl']['comigs-1g1s'])} | {ci} | {verdict(base, x['test_ppl'], mean, half)} | "
                    f"{loss[0]:.3f} -> {loss[-1]:.3f} | {ent[0]:.3f} / {ent[len(ent) // 2]:.3f} / {ent[-1]:.3f} | "
                    f"{x['generalist_share']:.3f} |")
    case = r.get("x1_against_case")
    # scales measured apart (a later command adds a scale to the file) each name their own command
    runs: dict[tuple, list[str]] = {}
    for name, x in r["scales"].items():
        m = x.get("measured", r)
        # a scale whose seeds ran apart (bench/language_shift_scale.py keeps each seed): each run its seeds
        for g in m if isinstance(m, list) else [m]:
            label = name if "seeds" not in g or g["seeds"] == x["seeds"] else \
                f"{name} seed{'s' if len(g['seeds']) > 1 else ''} {', '.join(map(str, g['seeds']))}"
            if g.get("wall_s"):  # what a seed cost, for whoever plans the next one
                label += f" ({', '.join(f'{w / 60:.0f}' for w in g['wall_s'])} min)"
            runs.setdefault((g["command"].strip(), g["machine"], g["date"]), []).append(label)
    head = (f"On `{r['setting']}`: " + "; ".join(f"{', '.join(names)} by `{c}` ({machine}, {date})"
                                                 for (c, machine, date), names in runs.items()) + "."
            + ("" if not case else " x1 against the committed case's own runs (ours / theirs - 1): "
               + ", ".join(f"{k} {v:+.2%}" for k, v in case.items()) + "."))
    return "\n".join([head, "", *rows])


def large_upload_table(text: str) -> str:
    """bench/large_upload.py's result file: one device upload over 2 GB through a TLS + authenticated
    loopback deployment, whether it arrived bit for bit, its time and each process's peak memory."""
    r = json.loads(text)
    gb = r["upload_gb"]
    rows = [("upload (one fp32 tensor)", f"{gb:.2f} GB ({r['bytes']:,} bytes; protobuf's limit 2,147,483,647)"),
            ("arrived bit for bit (SHA-256)", "yes" if r.get("bit_exact") else "NO"),
            ("request to reply (device made it in)", f"{r['round_trip_s']:.0f} s ({r['made_s']:.0f} s)")]
    for key, what in (("device_clientapp_peak_rss_mb", "device: its ClientApp process"),
                      ("supernode_peak_rss_mb", "device: its SuperNode"), ("superlink_peak_rss_mb", "SuperLink"),
                      ("serverapp_peak_rss_mb", "server: the ServerApp (its own VmHWM)")):
        rows.append((f"peak RSS, {what}", f"{r[key] / 1024:.1f} GB ({r[key] / 1024 / gb:.1f}x the upload)"))
    return "\n".join([f"`{r['command'].strip()}`: {r['machine']}, {r['date']}, torch {r['torch']}, flwr {r['flwr']} "
                      f"(arrays cut into {r['chunk_mb']:g} MB chunks); the bench took {r['wall_s'] / 60:.1f} min.", "",
                      "| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def eval_clients_table(text: str) -> str:
    """bench/eval_clients.py's result file: a compare with every client scored every round against
    the same with ``train.eval_clients`` (a seeded sample before the last round): wall time, the
    scoring's share of it, client evaluations, and whether the last round's scores are identical."""
    r = json.loads(text)
    rows = ["| train.eval_clients | wall time | scoring (sum of eval_s) | client evaluations | peak RSS (MB) |",
            "|---|---:|---:|---:|---:|"]
    for k, x in r["runs"].items():
        rows.append(f"| {k}{' (every client)' if k == '0' else ''} | {x['wall_s'] / 60:.1f} min | "
                    f"{x['eval_s'] / 60:.1f} min | {x['scored']:,} | {x['peak_rss_mb']:,.0f} |")
    full, sampled = r["runs"]["0"], r["runs"][str(r["sample"])]
    return "\n".join(rows) + (
        f"\n\n`{r['config']}`, {r['machine']}, {r['date']}: the sample saves "
        f"{1 - sampled['wall_s'] / full['wall_s']:.0%} of the wall time; the last round's scores of all "
        f"{r['final_clients']} client-method pairs are {'identical' if r['final_scores_identical'] else 'NOT identical'} "
        "in both runs.")


def main_job_profile_table(text: str) -> str:
    """bench/main_job_profile.py's file: each phase's exclusive wall time in the main job."""
    r = json.loads(text)
    rows = ["| phase | seconds | share | timed calls |", "|---|---:|---:|---:|"]
    rows += [f"| {p['phase']} | {p['seconds']:,.1f} | {p['share']:.1%} | {p['calls']:,} |" for p in r["phases"]]
    return "\n".join(rows) + (f"\n\n`{r['command']}`: {r['machine']}, {r['threads']} threads, torch {r['torch']}, "
                              f"{r['date']}; the whole job {r['total_s'] / 60:.2f} min (imports included), "
                              f"peak RSS {r['peak_rss_mb'] / 1024:.1f} GB.")


def mutation_sweep_table(text: str) -> str:
    """bench/mutation_sweep.py's file: per module the one-line mutants and how many its tests kill,
    then each mutant with the first test that failed on it (or that none did)."""
    r = json.loads(text)
    mods: dict[str, list] = {}
    for m in r["mutants"]:
        mods.setdefault(m["module"], []).append(m)
    rows = ["| module | mutants | killed | equivalent | not killed |", "|---|---:|---:|---:|---|"]
    for mod, ms in mods.items():
        alive = [m["name"] for m in ms if m["outcome"] not in ("killed", "equivalent")]
        same = sum(m["outcome"] == "equivalent" for m in ms)
        rows.append(f"| {mod} | {len(ms)} | {len(ms) - len(alive) - same} | {same} | {', '.join(alive) or '-'} |")
    rows += ["", "| module | the edit: what a user would see | caught by |", "|---|---|---|"]
    for mod, ms in mods.items():
        for m in ms:
            test = (m["first_failure"].split("/")[-1].replace("::", " : ") if m["outcome"] == "killed" else
                    f"equivalent: {m['equivalent']}" if m["outcome"] == "equivalent" else f"**{m['outcome']}**")
            rows.append(f"| {mod} | {m['edit']} | {test} |")
    total = sum(len(ms) for ms in mods.values())
    killed = sum(m["outcome"] == "killed" for ms in mods.values() for m in ms)
    same = sum(m["outcome"] == "equivalent" for ms in mods.values() for m in ms)
    where: dict[tuple, list] = {}  # (machine, date) -> the modules whose mutants ran there and then
    for mod, ms in mods.items():
        for m in ms:
            at = where.setdefault((m.get("machine", r["machine"]), m.get("date", r["date"])), [])
            at.extend([mod] if mod not in at else [])
    ran = "; ".join(f"{mach}, {date}" + (f": {', '.join(at)}" if len(where) > 1 else "") for (mach, date), at in where.items())
    return "\n".join(rows) + (f"\n\n`{r['command']}` ({ran}): {killed} of {total} mutants "
                              f"killed, {same} equivalent (the edit changes nothing a user can see, measured); each ran "
                              "its module's tests with `-x` on a clean tree, the file restored after.")


BENCH_FILES = {"poisoned.json": poisoned_table, "language-shift-scale.json": language_shift_scale_table, "mutation-sweep.json": mutation_sweep_table, "eval-clients.json": eval_clients_table, "main-job-profile.json": main_job_profile_table, "soak.json": soak_table, "large-upload.json": large_upload_table, "device-export.json": device_export_table, "cohort-cpu-fp32.json": cohort_table, "layer-speed.md": layer_speed_table, "layer-speed-full.md": layer_speed_table,  # written by a bench
               "layer-speed-h200-bf16.md": layer_speed_table,
               "vaa-attribution.json": vaa_attribution_table, "vaa-attribution-long.json": vaa_attribution_table}
