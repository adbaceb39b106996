"""Train a small federation, take one user's personalised model home, and use it outside comix.

    python examples/train_export_reload.py            # ~30 s on 2 CPU cores (tiny random model)
    python examples/train_export_reload.py smollm2-135m   # the offline SmolLM2 (a few minutes)

1. ``comix.run``: FedAvg and CoMiGS-1G1S on the built-in multilingual corpus (4 users: de/fr/it/nl).
2. ``comix.export``: user ``de``'s FedAvg model as a standard PEFT LoRA folder, its CoMiGS model as
   one PEFT folder per expert + routers + a manifest.
3. Reload: the PEFT folder with plain ``peft.PeftModel.from_pretrained``; the mixture exactly with
   ``comix.load_personal``; both give the logits the run had.
"""
import sys
import tempfile
from pathlib import Path

import torch

import comix

model_name = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
work = Path(tempfile.mkdtemp(prefix="comix-example-"))
results = comix.run(model=model_name, methods=["fedavg", "comigs-1g1s"], run_dir=str(work / "run"),
                    train={"rounds": 2, "local_steps": 2, "batch_size": 2, "seq_len": 64, "tau": 2,
                           "router_steps": 1, "eval_every": 2, "eval_splits": ["test"]},
                    data={"valid_tokens": 2048, "test_tokens": 1024}, quiet=True)
for r in results:
    print(f"{r['method']}: mean test perplexity {r['mean']:.2f} over {len(r['per_user'])} users")

plain = comix.export(work / "run", user="de", out=work / "de-fedavg", method="fedavg")
mixture = comix.export(work / "run", user="de", out=work / "de-comigs", method="comigs-1g1s")

from peft import PeftModel  # noqa: E402  (outside comix: plain PEFT on the plain base)

from comix.models import load_base_model  # noqa: E402  (the same base weights comix trained on)

ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(0))
peft_model = PeftModel.from_pretrained(load_base_model(model_name)[0], str(plain)).eval()
exact, _ = comix.load_personal(plain)
with torch.no_grad():
    gap = (peft_model(input_ids=ids).logits - exact(input_ids=ids).logits).abs().max().item()
print(f"FedAvg user de via PEFT: max |logit difference| to comix's model = {gap:.2e}")

moe, tok = comix.load_personal(mixture)
print(f"CoMiGS user de reloaded from {mixture} (experts: {sorted(p.name for p in (mixture / 'experts').iterdir())})")
out = moe.generate(**tok("Hallo", return_tensors="pt"), max_new_tokens=8, do_sample=False,
                   pad_token_id=tok.pad_token_id)
print("generated:", repr(tok.decode(out[0])))
print(f"everything is under {work}")
