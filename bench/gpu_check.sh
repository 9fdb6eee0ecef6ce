#!/usr/bin/env bash
# bench/gpu_check.sh: vega's Triton backend on an NVIDIA GPU (written for an H200), in one run
# of about 6 to 8 minutes, from the repository root:
#
#     bash bench/gpu_check.sh      # results in $OUT (default ./gpu_check_out)
#
# 1. a CUDA build of torch: the machine's own if `torch.cuda.is_available()` already (vega is
#    then installed with --no-deps, so pip cannot replace that torch with constraints.txt's
#    pin); otherwise torch==<constraints.txt's pin> and triton==<pin> from the package
#    registry (the registry's Linux x86_64 torch wheels are CUDA builds; the pin file's CPU
#    build is a local wheel of the development machines), then the README's `pip install -c constraints.txt -e .`;
# 2. the Triton test files on the GPU (TRITON_INTERPRET unset), in parallel where
#    pytest-xdist is installed;
# 3. bench/gpu_check.py: correctness against the reference backend on CUDA
#    (AdamW, LAMB, SGD, Adafactor; float32 and bfloat16; plain and clip+skip), A/B variants
#    of the update kernel, AdamW bandwidth at ~14M / 124M / 1.2B parameters against torch's
#    fused AdamW, launches per step (torch.profiler), host syncs
#    (torch.cuda.set_sync_debug_mode("error")), CUDA graphs, a tensor past 2**31 elements,
#    torch.compile(fullgraph=True), and last a destructive CUDA-graph hazard probe.
#
# Environment: OUT (results), PYTHON (default python3), VEGA_CHECK_BUDGET (seconds for the
# whole run, default 470), VEGA_WHEELS (a folder of wheels for a machine without a package
# index: lark is the one vega needs that a CUDA image usually lacks), VEGA_TEST_WORKERS
# (pytest-xdist workers, default 12), VEGA_SKIP_TESTS=1, VEGA_SECTIONS=a,b (python sections),
# VEGA_KEEP_TORCH=1 (keep the installed torch even without CUDA: with VEGA_CHECK_DRY=1 this
# smoke-tests the script on a CPU machine, the kernels under Triton's interpreter).
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${VEGA_CHECK_BUDGET:-470}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
say() { printf '[%4ss] %s\n' "$(( $(date +%s) - START ))" "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
pin() { sed -n "s/^$1==//p" constraints.txt | head -n 1; }
cuda_torch() { $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

[ -f pyproject.toml ] && [ -d vega ] || { echo "run from vega's repository root"; exit 2; }
: > "$OUT/summary.txt"

# -- 1. torch with CUDA, and vega ---------------------------------------------------------
if cuda_torch || [ "${VEGA_KEEP_TORCH:-0}" = 1 ]; then
    MODE=machine
    say "keeping the installed torch: $($PY -c 'import torch, triton; print(torch.__version__, "cuda", torch.cuda.is_available(), "/ triton", triton.__version__)' 2>&1 | tail -n 1)"
else
    MODE=pinned
    say "no CUDA torch here: installing torch==$(pin torch) triton==$(pin triton) from the package registry"
    PIP_FIND_LINKS= PIP_CONSTRAINT= $PY -m pip install -q \
        ${VEGA_INDEX_URL:+--index-url "$VEGA_INDEX_URL"} \
        "torch==$(pin torch)" "triton==$(pin triton)" 2>&1 | tail -n 5
    cuda_torch || { say "FATAL: torch sees no CUDA device"; nvidia-smi 2>&1 | tail -n 20; exit 2; }
fi
if [ "$MODE" = pinned ]; then
    PIP_FIND_LINKS= $PY -m pip install -q \
        ${VEGA_INDEX_URL:+--index-url "$VEGA_INDEX_URL"} -c constraints.txt -e . 2>&1 | tail -n 5
else
    missing=$($PY - <<'EOF'
import importlib.util
print(" ".join(m for m in ("lark", "jinja2", "numpy", "safetensors", "pytest")
               if importlib.util.find_spec(m) is None))
EOF
)
    if [ -n "$missing" ]; then
        reqs=""
        for m in $missing; do reqs="$reqs $(grep -E "^$m==" constraints.txt || echo "$m")"; done
        say "installing what this machine lacks:$reqs"
        if ls "${VEGA_WHEELS:-.whl}"/*.whl >/dev/null 2>&1; then
            $PY -m pip install -q --no-index --find-links "${VEGA_WHEELS:-.whl}" $reqs 2>&1 | tail -n 3
        else
            $PY -m pip install -q $reqs 2>&1 | tail -n 3
        fi
    fi
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 3 ||
        $PY -m pip install -q --no-deps -e . 2>&1 | tail -n 3
fi
if ! (cd / && $PY -c 'import vega' 2>/dev/null); then
    # not installed (an offline machine whose setuptools is older than pyproject.toml's
    # build needs): the checkout itself, on the path, for the scripts run from bench/ too
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    say "vega did not install: importing it from this checkout (PYTHONPATH=$PWD)"
fi
$PY -c 'import vega, lark, jinja2' || { say "FATAL: vega does not import"; exit 2; }
{
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
    $PY -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} > "$OUT/env.txt" 2>&1
say "$(tr '\n' ' ' < "$OUT/env.txt" | cut -c1-300)"
say "set-up done ($MODE torch)"

# -- 2. the Triton test files on the GPU ------------------------------------------------------
if [ "${VEGA_SKIP_TESTS:-0}" != 1 ]; then
    par=""
    $PY -c 'import xdist' 2>/dev/null && par="-n ${VEGA_TEST_WORKERS:-12}"
    tmo=""
    $PY -c 'import pytest_timeout' 2>/dev/null && tmo="--timeout=200"
    t=$(( $(left) - 250 ))
    [ "$t" -gt 200 ] && t=200
    if [ "$t" -lt 60 ]; then
        say "tests skipped: only $(left)s left"
    else
        say "tests/codegen/test_triton.py, test_triton_axes.py on the GPU (limit ${t}s, ${par:-serial})"
        timeout -k 10 "$t" $PY -m pytest -q -p no:cacheprovider $par $tmo -rfE \
            tests/codegen/test_triton.py tests/codegen/test_triton_axes.py > "$OUT/pytest.log" 2>&1
        rc=$?
        say "pytest exit $rc: $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -n 1)"
        grep -E '^(FAILED|ERROR)' "$OUT/pytest.log" | head -n 30 | tee -a "$OUT/summary.txt"
    fi
fi

# -- 3. the checks --------------------------------------------------------------------------------
t=$(( $(left) - 5 ))
say "bench/gpu_check.py (budget ${t}s)"
OUT="$OUT" VEGA_PY_BUDGET="$t" timeout -k 10 $(( t + 60 )) $PY bench/gpu_check.py 2>&1 | tee "$OUT/check.log"
say "done in $(( $(date +%s) - START ))s; logs in $OUT"
