#!/usr/bin/env bash
# The GPU suite: what trl_cb must show on a GPU, most important first, each step under its own time limit and every
# point written to its JSON as soon as it is measured, so that a step that overruns loses only its own remaining
# points. About 8 minutes on an H100 (the default budget, 480 s).
#
#   bash benchmarks/gpu_suite.sh                          # CUDA, llama-1b-random, results in runs/gpu_suite-<time>/
#   bash benchmarks/gpu_suite.sh --quick --device cpu     # the whole suite end to end on a CPU, tiny model (~2 min)
#   bash benchmarks/gpu_suite.sh --wheels .whl --out /tmp/gpu-res --budget 540
#
# Steps (limits in seconds; GPU_SUITE_LIMIT_<STEP>=N overrides one, e.g. GPU_SUITE_LIMIT_SEED=300):
#   1. gpu-tests (90):   pytest -m gpu: the GPU-only tests (exactness, graphs, attention kernels).
#   2. profile (60):     step_profile.py: host ms, device ms, kernels and device ms by kernel family per decode step at
#                        256 and 1,024 rows (torch.profiler, CPU and CUDA activities).
#   3. engine-step (90): ms per decode step against generate() at 32, 256 and 1,024 rows (CUDA graphs on).
#   4. seed (210):       the seed comparison, gsm8k.py: N = 8/32/64 at 512 tokens with the calibrated GSM8K-like
#                        tail; generate(), TRL's native CB, trl_cb with and without CUDA graphs.
#   5. grpo-step (120):  GRPO training steps, 8 prompts x 8, <= 512 tokens: generate(), trl_cb sync, async, overlap.
# Offline machines: `--wheels DIR` installs the wheels of ../shared/gpu/wheelhouse.sh (or any folder) into
# /tmp/trl_cb_site and puts it first on PYTHONPATH. Everything goes to OUT: log.txt (the whole run), one JSON (and
# PNG) per benchmark step, pytest's report, and results.tgz re-packed after every step.
set -u
cd "$(dirname "$0")/.."
DEVICE=cuda QUICK=0 BUDGET=480 WHEELS="" OUT="runs/gpu_suite-$(date +%Y%m%d-%H%M%S)"
while [ $# -gt 0 ]; do
    case $1 in
        --quick) QUICK=1 ;;
        --device) DEVICE=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        --wheels) WHEELS=$2; shift ;;
        --out) OUT=$2; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "gpu_suite.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
START=$(date +%s); DEADLINE=$((START + BUDGET))
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [ -n "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/trl_cb_site \
        "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/trl_cb_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PY=$(command -v python3)

save() {  # log.txt is still being written (tee): tar's "file changed as we read it" (rc 1) is expected, not a failure
    tar -czf "$OUT/results.tgz" --exclude=results.tgz -C "$OUT" . 2>/dev/null
    [ $? -le 1 ]
}
step() {  # step NAME LIMIT CMD... : skipped when the budget is spent, cut at its limit (rc 124), results kept
    local name=$1 secs=$2 left=$((DEADLINE - $(date +%s))) var
    shift 2
    var="GPU_SUITE_LIMIT_$(echo "$name" | tr 'a-z-' 'A-Z_')"
    secs=${!var:-$secs}
    if [ "$left" -lt 20 ]; then echo "### SKIP $name (${left}s of the budget left)"; return; fi
    [ "$secs" -gt "$left" ] && secs=$left
    echo "### STEP $name (limit ${secs}s, t=$(($(date +%s) - START))s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$secs" "$@"
    rc=$?
    echo "### END $name rc=$rc in $(($(date +%s) - t0))s$([ $rc = 124 ] && echo ' (time limit: its points so far are kept)')"
    save
}

echo "### gpu_suite: device=$DEVICE quick=$QUICK budget=${BUDGET}s out=$OUT commit=$(git rev-parse --short HEAD 2>/dev/null)"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch, transformers, trl, trl_cb; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, 'trl_cb', trl_cb.__version__, 'from', trl_cb.__file__)"

COMMON=(--device "$DEVICE" --out "$OUT")
if [ "$QUICK" = 1 ]; then  # the same steps on the smallest settings: the orchestration, not the figures
    MODEL=tiny ROWS=(8 16) TOKENS=16 NS=(2) ENGINE=(--models null --max-new-tokens 4 --samples-per-prompt 4)
    PROFILE=(--model null --rows 8 16 --max-new-tokens 4)
    COMMON+=(--quick)
    GRPO=(--backends trl_cb trl_cb_async)
else
    MODEL=llama-1b-random ROWS=(32 256 1024) TOKENS=512 NS=(8 32 64)
    ENGINE=(--models llama-1b-random --max-new-tokens 64)
    PROFILE=(--model llama-1b-random --rows 256 1024 --max-new-tokens 32)
    GRPO=(--backends generate trl_cb trl_cb_async trl_cb_overlap_async --prompts 8 --num-generations 8 --steps 3)
fi

step gpu-tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests --junitxml "$OUT/pytest-gpu.xml"
step profile 60 "$PY" benchmarks/step_profile.py --device "$DEVICE" --out "$OUT" "${PROFILE[@]}"
step engine-step 90 "$PY" benchmarks/engine_step.py "${COMMON[@]}" "${ENGINE[@]}" --rows "${ROWS[@]}" --repeats 2
SEED_BACKENDS=(generate trl_native trl_cb trl_cb_no_graphs)
[ "$QUICK" = 1 ] && SEED_BACKENDS=(generate trl_cb trl_cb_no_graphs)
step seed 210 "$PY" benchmarks/gsm8k.py "${COMMON[@]}" --model "$MODEL" --max-new-tokens "$TOKENS" \
    --num-generations "${NS[@]}" --prompts-per-round 4 --repeats 1 --no-tail-generations \
    --backends "${SEED_BACKENDS[@]}"
step grpo-step 120 "$PY" benchmarks/grpo_step.py "${COMMON[@]}" --model "$MODEL" --trainers grpo \
    --max-completion-length "$TOKENS" "${GRPO[@]}"
echo "### done in $(($(date +%s) - START))s; results in $OUT"
save
