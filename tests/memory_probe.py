"""Measures one training step's memory as the operating system sees it, for
tests/test_footprint.py: run as ``python memory_probe.py MODEL BATCH SEQ`` with glibc told to give
freed memory back at once (MALLOC_TRIM_THRESHOLD_=0, MALLOC_MMAP_THRESHOLD_=65536), so that the
resident set follows what is allocated. Prints one JSON line: comix's counts (``training_memory``,
the planner's; ``Footprint``'s step peak) and the process's resident memory before the step and
its peak during it (Linux's VmHWM, reset through /proc/self/clear_refs)."""
import json
import sys

import torch


def main(model_name: str, batch: int, seq: int) -> None:
    from comix.algorithms.training import lm_loss
    from comix.config import load_config
    from comix.data import load_corpus, make_user_data
    from comix.engines.device import training_memory
    from comix.engines.footprint import Footprint
    from comix.runtime import process_memory_mb
    from comix.models import inject_adapters, load_base_model
    from comix.specs import build_algorithm

    torch.manual_seed(0)
    cfg = load_config(None, [f"model={model_name}", f"train.batch_size={batch}", f"train.seq_len={seq}",
                             "data.valid_tokens=512", "data.test_tokens=512"])
    base, tok = load_base_model(model_name)
    algorithm = build_algorithm(cfg, "fedavg", 1)
    user = make_user_data(load_corpus(cfg.corpus), tok, cfg.data)[0]
    need = training_memory(base, algorithm, user, precisions=("none",))["none", 1]  # the planner's count (a copy of the base)
    model = inject_adapters(base, algorithm.adapter_config(0)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step():
        lm_loss(model, x, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step creates AdamW's moments and the kernels' caches
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = process_memory_mb()
    with Footprint(model) as footprint:
        step()
    print(json.dumps({"planned_mb": need, "step_mb": footprint.peak / 2**20, "rss_before_mb": before,
                      "rss_peak_mb": process_memory_mb(field="VmHWM")}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
