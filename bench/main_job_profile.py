"""Where every second of the main job goes: ``comix run`` (the offline default, or a config and
overrides) in this process, each phase's *exclusive* wall time (a phase's time less the phases
called inside it), so the rows add up to the whole.

    python bench/main_job_profile.py                       # the main job, fp32, as the README runs it
    python bench/main_job_profile.py train.cohort=4 --out bench/results/main-job-profile-cohort4.json
    python bench/main_job_profile.py device=cuda precision=bf16 --out ...   # on a GPU (bench/gpu.sh)

Phases are found by wrapping comix's own functions (every place a module bound them), not by
sampling: import; loading the base model; reading, tokenising and splitting the corpus; moving
the model to the device; the clients' training, split into the steps themselves (forward,
backward, optimiser: ``train_step``, a cohort's ``CohortStep``), CoMiGS's router steps and the
round's other client work (payload, batches, states); evaluation; the server's aggregation;
files (checkpoints, client states, metrics, adapters: ``atomic_write`` and the packing of
states); the report; and what is left (the run loop, the table, logging). On CUDA every phase
ends with a device synchronise, so a phase's kernels are counted in it. Writes
bench/results/main-job-profile.json (``--out``), which bench/tables.py renders.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import time

T0 = time.perf_counter()
import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402, F401

import comix  # noqa: E402
import comix.algorithms  # noqa: E402
import comix.api  # noqa: E402
import comix.engines.device  # noqa: E402
import comix.engines.inprocess  # noqa: E402
import comix.runner  # noqa: E402

IMPORT_S = time.perf_counter() - T0
ROOT = Path(__file__).resolve().parents[1]


class Phases:
    """Exclusive wall time per phase: a stack of the phases entered, each one's children's time
    subtracted from it."""

    def __init__(self, cuda: bool):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []  # [phase, start, time spent in children]
        self.cuda = cuda

    def wrap(self, phase: str, fn, yields_to: tuple[str, ...] = ()):
        """``fn`` timed as ``phase``, or as the phase it was called in when that is in ``yields_to``
        (a router step's forward and backward count as router steps)."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._sync()
            name = self.stack[-1][0] if self.stack and self.stack[-1][0] in yields_to else phase
            self.stack.append([name, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                name, start, children = self.stack.pop()
                spent = time.perf_counter() - start
                self.seconds[name] = self.seconds.get(name, 0.0) + spent - children
                self.calls[name] = self.calls.get(name, 0) + 1
                if self.stack:
                    self.stack[-1][2] += spent
        timed.__wrapped_phase__ = phase
        return timed

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def patch_function(module_name: str, name: str, phase: str, phases: Phases, yields_to: tuple[str, ...] = ()) -> None:
    """``module.name`` wrapped everywhere comix bound it (``from x import name`` copies the binding)."""
    original = getattr(sys.modules[module_name], name)
    timed = phases.wrap(phase, original, yields_to)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("comix") and getattr(mod, name, None) is original:
            setattr(mod, name, timed)


def patch_method(cls, name: str, phase: str, phases: Phases) -> None:
    """``cls.name`` and every override of it in a subclass, wrapped."""
    seen = set()
    for c in [cls, *_subclasses(cls)]:
        if name in c.__dict__ and (c, name) not in seen:
            seen.add((c, name))
            setattr(c, name, phases.wrap(phase, c.__dict__[name]))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def instrument(phases: Phases) -> None:
    import comix.algorithms.cohort as cohort
    from comix.algorithms.base import Algorithm
    from comix.engines.device import Device
    from comix.engines.inprocess import InProcess
    patch_function("comix.models", "load_base_model", "load the base model", phases)
    for fn in ("load_corpus", "make_user_data", "token_table"):
        patch_function("comix.data", fn, "read, tokenise and split the corpus", phases)
    patch_function("comix.models.quant", "on_device", "base to the device (and quantise)", phases)
    patch_method(Device, "train", "training: other client work (payload, batches, states)", phases)
    patch_method(InProcess, "_train_cohort", "training: other client work (payload, batches, states)", phases)
    steps, routers = "training: the steps (forward, backward, AdamW)", "training: router steps (CoMiGS)"
    patch_function("comix.algorithms.training", "train_step", steps, phases, yields_to=(routers,))
    patch_method(cohort.CohortStep, "__call__", steps, phases)
    patch_method(Algorithm, "after_expert_step", routers, phases)
    patch_function("comix.algorithms.cohort", "cohort_step", routers, phases, yields_to=(steps,))
    patch_function("comix.models", "inject_adapters", "build each method's model (adapters)", phases)
    patch_method(Device, "init", "build each method's model (adapters)", phases)
    patch_method(Device, "evaluate", "evaluation", phases)
    patch_function("comix.engines.device", "evaluate", "evaluation", phases)  # also what scores Pretrained
    patch_function("comix.engines.device", "evaluate_cohort", "evaluation", phases)
    patch_method(InProcess, "_evaluate_cohorts", "evaluation", phases)
    patch_method(Algorithm, "server_round", "server: aggregation", phases)
    patch_function("comix.files", "atomic_write", "files: checkpoints, states, metrics, adapters", phases)
    patch_function("comix.engines.states", "pack", "files: checkpoints, states, metrics, adapters", phases)
    patch_function("comix.api", "_report", "report (report.html)", phases)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="key=value, as `comix run` takes them (the main job: none)")
    ap.add_argument("--config", default=None, help="a config file (default: the main job)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "main-job-profile.json"))
    ap.add_argument("--run-dir", default="", help="keep the run there (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    import tempfile
    cuda = any(o in ("device=cuda", "device=auto") for o in args.overrides) and torch.cuda.is_available()
    phases = Phases(cuda)
    instrument(phases)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        comix.api.run(args.config, *args.overrides, f"run_dir={args.run_dir or tmp + '/run'}", quiet=True)
        total = time.perf_counter() - t0
    counted = sum(phases.seconds.values())
    rows = [{"phase": "import (torch, transformers, comix)", "seconds": round(IMPORT_S, 2), "calls": 1}]
    rows += [{"phase": p, "seconds": round(s, 2), "calls": phases.calls[p]}
             for p, s in sorted(phases.seconds.items(), key=lambda kv: -kv[1])]
    rows.append({"phase": "the rest (run loop, table, logging)", "seconds": round(total - counted, 2), "calls": 1})
    whole = IMPORT_S + total
    for r in rows:
        r["share"] = round(r["seconds"] / whole, 4)
    out = {"command": " ".join(["python bench/main_job_profile.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": footprint.cpu_name() if not cuda else torch.cuda.get_device_name(),
           "threads": torch.get_num_threads(), "date": date.today().isoformat(), "torch": torch.__version__,
           "total_s": round(whole, 2), "peak_rss_mb": round(footprint.peak_rss_mb(), 1), "phases": rows}
    for r in rows:
        print(f"{r['phase']:60s} {r['seconds']:9.2f} s  {r['share']:6.1%}  ({r['calls']} calls)")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"total {whole:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
