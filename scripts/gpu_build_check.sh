#!/usr/bin/env bash
# `make gpu-build-check`: the device check's CUDA build and its CPU part, rehearsed on a machine with
# nvcc and no GPU (docs/gpu.md#proving-the-cuda-build-here-make-gpu-build-check). Nothing built runs.
#
#   1. venv   a throwaway venv OUTSIDE the checkout ($GPU_BUILD_VENV, default /tmp/gpu-build-venv,
#             made once with $GPU_BUILD_PYTHON, default python3.12 as on the image): PyPI's torch
#             2.11.0 (a CUDA 13.0 build), the image's versions from requirements/gpu-image.txt,
#             the lock's for everything else (what the device gets as carried wheels).
#   2. build  grouped_gemm, then megablocks + stanford-stk, from the sdists in .gpu-sdists/
#             (`bash scripts/gpu_check.sh fetch` when missing), patched by
#             scripts/patch_gpu_sdists.py as on the device, for sm_90 into $WORK/site, timed.
#   3. cpu    the check's CPU commands under those versions: corpus, `moe-lit fit` of tiny-moe on
#             the CPU, pytest of tests/gpu (CUDA tests skip) and the CPU tests of private APIs.
#
# Log: benchmarks/results/gpu-build-check-<date>.log; summary (versions, per-step exit code and
# seconds, test counts): benchmarks/results/gpu-build-check-<date>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_BUILD_VENV:-/tmp/gpu-build-venv}
WORK=${GPU_BUILD_DIR:-/tmp/gpu-build-check}
SDISTS=.gpu-sdists
SDIST_NAMES=(grouped_gemm-0.3.0 megablocks-0.10.0 stanford_stk-0.7.1)
DAY=$(date -u +%F)
RESULTS=benchmarks/results
LOG=$RESULTS/gpu-build-check-$DAY.log
SUMMARY=$RESULTS/gpu-build-check-$DAY.json
PY=$VENV/bin/python
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-2}

mkdir -p "$RESULTS" && rm -rf "$WORK" && mkdir -p "$WORK/build"
STEPS=$WORK/steps.jsonl
exec > >(tee "$LOG") 2>&1
stamp() { echo "== $(date -u +%T) $*"; }
# step NAME CMD...: run CMD, print and record its exit code and seconds as one JSON line.
step() {
  local name=$1 start rc
  shift
  stamp "$name"
  start=$(date +%s)
  "$@"
  rc=$?
  echo "-- $name: exit $rc in $(( $(date +%s) - start )) s"
  printf '{"step": "%s", "exit": %d, "seconds": %d}\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$STEPS"
  return $rc
}

make_venv() {
  cat requirements/gpu-image.txt requirements/lock.txt | cmp -s - "$VENV/.gpu-build-check" && return 0
  local python=${GPU_BUILD_PYTHON:-python3.12}
  # NOTE: pyenv's python3.12 shim runs only where 3.12 is the selected version; its folder always does.
  "$python" -c "" 2>/dev/null || python=$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3 2>/dev/null | tail -n 1)
  [[ -n $python ]] || { echo "no Python 3.12 (the image's): set GPU_BUILD_PYTHON=/path/to/python3.12"; return 2; }
  rm -rf "$VENV" && "$python" -m venv "$VENV" || return
  "$PY" -m pip install -q --upgrade pip || return
  # NOTE: PyPI's default linux torch 2.11.0 wheel is the image's CUDA 13.0 build (2.11.0+cu130).
  "$PY" -m pip install -q torch==2.11.0 ninja || return
  "$PY" - requirements/lock.txt requirements/gpu-image.txt > "$WORK/requirements.txt" <<'EOF' || return
# The lock with each version the image pins put in its place (torch stays the CUDA build above).
import re, sys
pin = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#+]+)")
def norm(name): return re.sub(r"[-_.]+", "-", name).lower()
image = {norm(m[1]): m[2] for line in open(sys.argv[2]) if (m := pin.match(line))}
for line in open(sys.argv[1]):
    if (m := pin.match(line)) and norm(m[1]) != "torch":
        print(f"{m[1]}=={image.get(norm(m[1]), m[2])}")
EOF
  # NOTE: --no-deps as `make venv` installs the lock: its resolution holds, torch is not replaced.
  "$PY" -m pip install -q --no-deps -r "$WORK/requirements.txt" 2>&1 | grep -v "is ignored: it is neither" 
  (( PIPESTATUS[0] == 0 )) || return
  # NOTE: a package at the image's version may need what the lock's did not (huggingface-hub 1.33:
  # httpx): pip check names it, installed with the pins above held; torchvision stays out (Makefile).
  local missing
  missing=$("$PY" -m pip check | sed -nE 's/.* requires ([^,]+), which is not installed\./\1/p' | grep -vx torchvision | sort -u)
  echo "added for the image's versions: ${missing:-nothing}"
  if [[ -n $missing ]]; then
    echo "torch==2.11.0" >> "$WORK/requirements.txt"
    "$PY" -m pip install -q -c "$WORK/requirements.txt" $missing 2>&1 | grep -v "is ignored: it is neither"
    (( PIPESTATUS[0] == 0 )) || return
  fi
  "$PY" -m pip check || true
  cat requirements/gpu-image.txt requirements/lock.txt > "$VENV/.gpu-build-check"
}

fetch_sdists() {
  local name
  for name in "${SDIST_NAMES[@]}"; do
    [[ -f $SDISTS/$name.tar.gz ]] || { PYTHON=$PY bash scripts/gpu_check.sh fetch; return; }
  done
  ls -la "$SDISTS"
}

extract_and_patch() {
  local name
  for name in "${SDIST_NAMES[@]}"; do
    tar xzf "$SDISTS/$name.tar.gz" -C "$WORK/build" || return
  done
  "$PY" scripts/patch_gpu_sdists.py "$WORK/build"
}

# build LOGNAME SOURCE...: pip-install SOURCE... into $WORK/site as the device does; the compiler's
# errors (or the log's tail) into this log.
build() {
  local log=$WORK/$1.log rc
  shift
  local sources=("${@/#/$WORK/build/}")
  nice -n 15 "$PY" -m pip install -v --no-deps --no-build-isolation --no-index --target "$WORK/site" "${sources[@]}" \
    > "$log" 2>&1
  rc=$?
  grep -E "error|warning: .*deprecated" "$log" | sort | uniq -c | sort -rn | head -n 40
  tail -n 5 "$log"
  return $rc
}

imports_built() {
  PYTHONPATH="$WORK/site" "$PY" -c "
import grouped_gemm, megablocks, megablocks_ops, grouped_gemm_backend
print('imported', megablocks.__file__, megablocks_ops.__file__, grouped_gemm_backend.__file__)"
}

# keep_prebuilt: the compiled site, for the device check's build step to try first (git-ignored).
keep_prebuilt() {
  rm -rf .gpu-prebuilt && mkdir -p .gpu-prebuilt && cp -r "$WORK/site" .gpu-prebuilt/site && du -sb .gpu-prebuilt
}

corpus() {
  "$PY" -c "from pathlib import Path; from tests.helpers.corpus import prepare_corpus
prepare_corpus(Path('$WORK/cpu'), paragraphs=40, val_fraction=0.1, test_fraction=0.1)"
}

fit_cpu() {
  "$PY" -m moe_lit.console_script fit --config configs/experiments/tiny-moe.yaml --data.data_dir "$WORK/cpu/data" \
    --data.seq_len 64 --data.batch_size 8 --data.val_batches 2 --trainer.enable_progress_bar false \
    --trainer.log_every_n_steps 1 --train.max_steps 6 --checkpoint.every_n_train_steps 3 --out "$WORK/cpu/fit" \
    && ls "$WORK/cpu/fit/checkpoints"
}

# NOTE: two tests of the version gate assert that the installed torch is the lock's, which the
# image's is not (the gate itself is what the check lifts); every other test runs.
pytest_cpu() {
  "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml "$WORK/pytest.xml" tests/gpu tests/test_compat.py \
    tests/model/test_expert_ops.py --deselect tests/test_compat.py::test_installed_releases_are_the_tested_ones \
    --deselect tests/test_compat.py::test_private_grouped_mm_only_on_a_tested_torch
}

# The JSON summary (versions, steps, test counts); exits 1 when a step failed.
summarize() {
  stamp "summary: $SUMMARY (log: $LOG)"
  local python=$PY
  [[ -x $python ]] || python=python3
  "$python" - "$STEPS" "$WORK/pytest.xml" "$SUMMARY" <<'EOF'
import importlib.metadata as md, json, subprocess, sys
import xml.etree.ElementTree as ET

steps_file, junit, out = sys.argv[1:]
names = ["torch", "triton", "transformers", "lightning", "pytorch-lightning", "torchmetrics", "numpy", "tokenizers",
         "huggingface-hub", "jsonargparse", "docstring-parser", "typeshed-client", "litdata", "boto3"]
versions = {"python": sys.version.split()[0]}
for name in names:
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = None
versions["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
try:
    suite = ET.parse(junit).getroot().find("testsuite")
    tests = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError, AttributeError) as exc:
    tests = {"error": str(exc)}
steps = [json.loads(line) for line in open(steps_file)]
summary = {"versions": versions, "steps": steps, "pytest": tests, "ok": all(s["exit"] == 0 for s in steps)}
with open(out, "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["ok"] else 1)
EOF
}

stamp "machine: $(uname -m), $(nproc) cores; $(nvcc --version | tail -n 1); CUDA_HOME=$CUDA_HOME"
step venv make_venv || { summarize; exit 1; }
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
step sdists fetch_sdists && step patch extract_and_patch
CPATH=$("$PY" scripts/patch_gpu_sdists.py --cuda-includes)
export CPATH
step build-grouped_gemm build grouped_gemm grouped_gemm-0.3.0
step build-megablocks build megablocks megablocks-0.10.0 stanford_stk-0.7.1
step import-built imports_built && step prebuilt keep_prebuilt

# NOTE: the device's environment for the CPU commands: the built packages importable, the version
# gate lifted (torch 2.11 is outside the lock's tested range).
export PYTHONPATH="$WORK/site:$PWD" MOE_LIT_ALLOW_UNTESTED=1
step cpu-corpus corpus && step cpu-fit fit_cpu
step cpu-pytest pytest_cpu

summarize
