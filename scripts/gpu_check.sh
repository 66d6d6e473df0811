#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (docs/gpu.md#the-gpu-check). Its step limits add up
# to 360 s, so a second attempt fits in the same 15-minute lease. Modes:
#
#   bash scripts/gpu_check.sh fetch
#       HERE, with PyPI: what the GPU machine's image (requirements/gpu-image.txt) lacks, into two
#       git-ignored folders the device call carries: .gpu-wheels/ (requirements/gpu-carry.txt, as
#       Python 3.12 manylinux/pure wheels) and .gpu-sdists/ (megablocks, stanford-stk, grouped_gemm).
#       Nothing else is downloaded: no dependency, no CUDA torch (grouped_gemm's metadata step runs on
#       this venv's CPU torch with a stand-in CUDA_HOME).
#
#   bash scripts/gpu_check.sh build
#       Build grouped_gemm and megablocks from .gpu-sdists into $GPU_SITE (default /tmp/gpu-site) with
#       $PYTHON's torch (in parallel; megablocks patched for CUDA 13's CUB). The check runs it. Where
#       .gpu-prebuilt/site (left by `make gpu-build-check`) imports against that torch, it is used instead.
#
#   bash scripts/gpu_check.sh
#       ON THE GPU MACHINE (no network; carry .gpu-wheels and .gpu-sdists):
#       run(command="bash scripts/gpu_check.sh", carry=[".gpu-wheels", ".gpu-sdists", ".gpu-prebuilt"], timeout_s=420)
#       Each step runs under its own limit, logs to $OUT/<step>.log and appends one JSON line to
#       $OUT/gpu_check.jsonl as it ends ($OUT: the device tool's folder, else benchmarks/results/gpu-check):
#       probe, carry (install the wheels), corpus, build (in the background from here on), `moe-lit fit`
#       with configs/trainer/{ddp,fsdp2,fsdp}.yaml and `backend: auto`, each interrupted at step 5 and
#       resumed, resume-compare (the resumed losses against the uninterrupted run's), parity (the
#       GPU-marked tests: MegaBlocks and the grouped GEMMs against the torch loop, a CPU-trained
#       checkpoint on MegaBlocks, the experts' ops on CUDA) and bench (benchmarks/gpu_throughput.py,
#       one JSON line per case in $OUT/gpu_throughput.jsonl). A failed or timed-out step is recorded
#       and the next one runs.
#
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh
#       The same steps on a CPU (tests/test_gpu_check.py): what needs no CUDA runs (corpus, a CPU fit of
#       ddp.yaml resumed and compared, fsdp2/fsdp.yaml parsed, the tests collected, the benchmark
#       imported), the rest writes its line with "skipped". Limits are not enforced (only recorded).
set -uo pipefail
cd "$(dirname "$0")/.."
SDISTS=.gpu-sdists
WHEELS=.gpu-wheels
CARRY_LIST=requirements/gpu-carry.txt
MEGABLOCKS=megablocks-0.10.0
STK=stanford_stk-0.7.1
GROUPED_GEMM=grouped_gemm-0.3.0
SITE=${GPU_SITE:-/tmp/gpu-site}
PREBUILT=.gpu-prebuilt

if [[ "${1:-}" == "fetch" ]]; then
  set -e
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$WHEELS" "$SDISTS"
  mkdir -p "$WHEELS" "$SDISTS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$WHEELS" -r "$CARRY_LIST"
  # NOTE: pip prepares each sdist's metadata by running its setup.py with this venv's (CPU) torch:
  # megablocks asks the GPU for its arch unless TORCH_CUDA_ARCH_LIST is set, and grouped_gemm's
  # CUDAExtension needs torch's CUDA_HOME, which a CPU torch leaves None: a stand-in sets it to an
  # empty folder for that step only (no CUDA torch is fetched, nothing is compiled or installed).
  stub=$(mktemp -d)
  mkdir -p "$stub/cuda/lib64"
  printf '%s\n' 'import os' 'import torch.utils.cpp_extension as cpp_extension' \
    'cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]' > "$stub/sitecustomize.py"
  PYTHONPATH=$stub CUDA_HOME=$stub/cuda TORCH_CUDA_ARCH_LIST=9.0 "$PY" -m pip download -q --no-deps \
    --no-build-isolation --no-binary=:all: -d "$SDISTS" megablocks==0.10.0 stanford-stk==0.7.1 grouped_gemm==0.3.0
  rm -rf "$stub"
  ls -l "$WHEELS" "$SDISTS"
  du -cb "$WHEELS" "$SDISTS" | tail -n 1
  exit 0
fi

PY=${PYTHON:-python3}

if [[ "${1:-}" == "build" ]]; then
  mkdir -p "$SITE"
  # NOTE: `make gpu-build-check` leaves the packages it compiled here (same sdists, patches, torch
  # 2.11+cu130, Python 3.12, sm_90) in .gpu-prebuilt/site: where they import against this machine's
  # torch, they save the compile; where they do not, they are removed and the sdists are built.
  if [[ -d $PREBUILT/site ]]; then
    cp -r "$PREBUILT/site/." "$SITE/"
    if PYTHONPATH="$SITE" "$PY" -c "import torch, megablocks_ops, grouped_gemm_backend, megablocks, grouped_gemm"; then
      echo "numbers: {\"prebuilt\": true, \"grouped_gemm_exit\": 0, \"megablocks_exit\": 0}"
      exit 0
    fi
    echo "the prebuilt packages do not import here: building from $SDISTS"
    rm -rf "$SITE" && mkdir -p "$SITE"
  fi
  BUILD=$(mktemp -d)
  for name in $MEGABLOCKS $STK $GROUPED_GEMM; do
    tar xzf "$SDISTS/$name.tar.gz" -C "$BUILD" || { echo "missing $SDISTS/$name.tar.gz (run: bash scripts/gpu_check.sh fetch)"; exit 1; }
  done
  # NOTE: the patches for CUDA 13 and the CUDA wheels' include folders, shared with `make gpu-build-check`.
  "$PY" scripts/patch_gpu_sdists.py "$BUILD" || exit 1
  CUDA_WHEEL_INCLUDES=$("$PY" scripts/patch_gpu_sdists.py --cuda-includes)
  export CPATH="${CUDA_WHEEL_INCLUDES}${CPATH:+:$CPATH}" TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  export MAX_JOBS=${MAX_JOBS:-12}
  install=("$PY" -m pip install --no-deps --no-build-isolation --no-index --target "$SITE")
  "${install[@]}" "$BUILD/$GROUPED_GEMM" > "$BUILD/grouped_gemm.log" 2>&1 &
  gg=$!
  "${install[@]}" "$BUILD/$MEGABLOCKS" "$BUILD/$STK" > "$BUILD/megablocks.log" 2>&1 &
  mb=$!
  wait $gg; gg_rc=$?
  wait $mb; mb_rc=$?
  tail -n 20 "$BUILD/grouped_gemm.log" "$BUILD/megablocks.log"
  echo "numbers: {\"grouped_gemm_exit\": $gg_rc, \"megablocks_exit\": $mb_rc}"
  exit $(( gg_rc || mb_rc ))
fi

DRY=${GPU_CHECK_DRY:-0}
OUT_DIR=${OUT:-benchmarks/results/gpu-check}
RESULTS="$OUT_DIR/gpu_check.jsonl"
WHEEL_SITE=/tmp/gpu-wheels
MATRIX=$(mktemp -d)
mkdir -p "$OUT_DIR"
: > "$RESULTS"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
# NOTE: the machine's torch is its own, not the lock's: the check exists to exercise the private
# APIs of moe_lit/_compat.py on it, so its version gate is lifted. No network: nothing may wait on one.
export MOE_LIT_ALLOW_UNTESTED=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$WHEEL_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# record NAME EXIT SECONDS LIMIT [SKIPPED_REASON]: the step's JSON line (scripts/gpu_check_results.py).
record() { "$PY" scripts/gpu_check_results.py record "$RESULTS" "$1" "$2" "$3" "$4" "$OUT_DIR/$1.log" "${5:-}"; }
# step NAME LIMIT COMMAND...: COMMAND under LIMIT seconds (a dry run records it, runs without it).
step() {
  local name=$1 limit=$2 began rc
  shift 2
  began=$(date +%s)
  if [[ $DRY == 1 ]]; then "$@"; else timeout -k 5 "$limit" "$@"; fi < /dev/null > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  record "$name" "$rc" "$(( $(date +%s) - began ))" "$limit"
}
# skipped NAME LIMIT REASON [EXIT]: the line of a step that does not run (its limit still counts).
skipped() { record "$1" "${4:-0}" 0 "$2" "$3"; }

step probe 10 "$PY" -c '
import json, shutil, subprocess, sys, torch
cuda = torch.cuda.is_available()
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.splitlines()[-1:] if shutil.which("nvcc") else []
print("numbers: " + json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
      "gpu": torch.cuda.get_device_name() if cuda else None, "devices": torch.cuda.device_count(), "nvcc": nvcc[0] if nvcc else None}))'

if [[ $DRY == 1 ]]; then
  skipped carry 15 "dry run: the image guard stands in for the installed wheels"
elif compgen -G "$WHEELS/*.whl" > /dev/null; then
  step carry 15 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WHEEL_SITE" "$WHEELS"/*.whl
else
  skipped carry 15 "no $WHEELS/*.whl (run here: bash scripts/gpu_check.sh fetch)" 1
fi

step corpus 15 "$PY" -c "from pathlib import Path; from tests.helpers.corpus import prepare_corpus
prepare_corpus(Path('$MATRIX'), paragraphs=40, val_fraction=0.1, test_fraction=0.1)"

if [[ $DRY == 1 ]]; then
  skipped build 120 "dry run: needs nvcc and a CUDA torch (make gpu-build-check compiles it here)"
elif [[ -d $SITE/megablocks && -d $SITE/grouped_gemm ]]; then
  skipped build 120 "built into $SITE by an earlier attempt on this machine"
else
  # NOTE: the build overlaps the fits (which never import its site: `backend: auto` resolves as
  # without the gpu extra there) and is waited for before the parity tests.
  step build 120 env GPU_SITE="$SITE" bash scripts/gpu_check.sh build &
  build_pid=$!
fi

# NOTE: the command users launch, with the shipped trainer files' own precision, clipping and fused
# AdamW, 10 steps resumed from the step-5 checkpoint (a dry run: 4 steps from step 2, on the CPU).
if [[ $DRY == 1 ]]; then steps=4 resume=2; else steps=10 resume=5; fi
# NOTE: the trainer file comes before the flags: a later --trainer FILE would reset them.
FIT=("$PY" -m moe_lit.console_script fit --config configs/experiments/tiny-moe.yaml)
FLAGS=(--data.data_dir "$MATRIX/data" --data.seq_len 64 --data.batch_size 8 --data.val_batches 2
  --trainer.enable_progress_bar false --trainer.log_every_n_steps 1 --train.precision null
  --train.max_steps "$steps" --checkpoint.every_n_train_steps "$resume" --checkpoint.save_top_k -1)
for trainer in ddp fsdp2 fsdp; do
  FIT_TRAINER=("${FIT[@]}" --trainer "configs/trainer/$trainer.yaml" "${FLAGS[@]}")
  if [[ $DRY == 1 && $trainer != ddp ]]; then
    step "fit-$trainer" 20 "${FIT_TRAINER[@]}" --print_config
    skipped "fit-$trainer-resume" 20 "dry run: only ddp.yaml trains on the CPU ($trainer.yaml parsed above)"
    continue
  fi
  [[ $DRY == 1 ]] && FIT_TRAINER+=(--trainer.accelerator cpu --trainer.devices 1)
  step "fit-$trainer" 20 "${FIT_TRAINER[@]}" --out "$MATRIX/$trainer"
  checkpoint=$(compgen -G "$MATRIX/$trainer/checkpoints/*step=$resume.ckpt" | head -n 1)
  if [[ -n $checkpoint ]]; then
    step "fit-$trainer-resume" 20 "${FIT_TRAINER[@]}" --out "$MATRIX/$trainer-resumed" --ckpt_path "$checkpoint"
  else
    skipped "fit-$trainer-resume" 20 "no step-$resume checkpoint from fit-$trainer" 1
  fi
  cp "$MATRIX/$trainer/logs/fit/metrics.csv" "$OUT_DIR/fit-$trainer-metrics.csv" 2> /dev/null
  cp "$MATRIX/$trainer-resumed/logs/fit-step$resume/metrics.csv" "$OUT_DIR/fit-$trainer-resumed-metrics.csv" 2> /dev/null
done
if [[ $DRY == 1 ]]; then compared=(ddp); else compared=(ddp fsdp2 fsdp); fi
step resume-compare 10 "$PY" scripts/gpu_check_results.py compare "$resume" "${compared[@]/#/$MATRIX/}"

if [[ $DRY == 1 ]]; then
  step parity 40 "$PY" -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/gpu tests/model/test_expert_ops.py
  step bench 30 "$PY" -m benchmarks.gpu_throughput --help
else
  [[ -n ${build_pid:-} ]] && wait "$build_pid"
  export PYTHONPATH="$SITE:$PYTHONPATH"
  step parity 40 "$PY" -m pytest -v -p no:cacheprovider -rs -m gpu tests/gpu tests/model/test_expert_ops.py
  step bench 30 "$PY" -m benchmarks.gpu_throughput --out "$OUT_DIR/gpu_throughput.jsonl" --steps 10 --warmup 3
fi
rm -rf "$MATRIX"
echo "== results ($RESULTS):"
cat "$RESULTS"
