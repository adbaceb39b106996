"""Why an ExecuTorch training program over a quantised frozen base does not build yet: for each of
comix's base quantisations (``quant=int8|nf4|q4``, models/quant.py) a FedAvg client model on the
tiny Llama is exported as models/executorch_training.py exports every device's step, and where it
stops (export, edge lowering, load), with the error's first line, is written down.

    python bench/executorch_quant.py [--out bench/results/executorch-quant.json]

Not asserted: the configuration check refuses ``quant`` with ``train.client_runtime=executorch`` in
one line before any work (comix/combinations.py); this file is the measured reason behind it.
"""
from __future__ import annotations

import footprint  # noqa: F401  (prints wall time and peak RSS at exit)

import argparse
import traceback
from datetime import date
from pathlib import Path

import torch

from comix.algorithms import TrainConfig, make_algorithm
from comix.engines.inprocess import ClientModels
from comix.models import LoRAConfig, load_base_model
from comix.models.executorch_training import ExecuTorchTraining
from comix.runtime import Runtime


def where(tb: list[traceback.FrameSummary]) -> str:
    """The stage that raised: the last frame of executorch, torch.export or the quantiser's own code."""
    for frame in reversed(tb):
        for part, stage in (("executorch/", "edge lowering (executorch)"), ("torch/export", "torch.export"),
                            ("torch/_subclasses", "torch.export (fake tensors)"), ("bitsandbytes/", "the quantised layer (bitsandbytes)"),
                            ("comix/", "comix")):
            if part in frame.filename:
                return f"{stage}: {Path(frame.filename).name}:{frame.lineno}"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--out", default="bench/results/executorch-quant.json")
    args = ap.parse_args()
    rows = {}
    for quant in ("int8", "nf4", "q4"):
        base, _ = load_base_model(args.model)
        algo = make_algorithm("fedavg", LoRAConfig(r=4), TrainConfig(), 1)
        model = ClientModels(base, algo, Runtime(quant=quant)).for_client(0)
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, model.config.vocab_size, (2, 16), generator=gen) for _ in range(2))
        try:
            ExecuTorchTraining(model, x, y)
            rows[quant] = {"builds": True}
        except Exception as e:  # noqa: BLE001  (the point is to record whatever stops it)
            rows[quant] = {"builds": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                           "stage": where(traceback.extract_tb(e.__traceback__))}
        print(quant, rows[quant], flush=True)
    footprint.write_result(Path(args.out), {"model": args.model, "date": date.today().isoformat(),
                                            "torch": torch.__version__, "quant": rows})


if __name__ == "__main__":
    main()
