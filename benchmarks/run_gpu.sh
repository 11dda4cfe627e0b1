#!/usr/bin/env bash
# One command for the day a GPU is there: the CUDA extension, the cuda-marked tests, every backend against the
# float64 oracle at real sizes, the GPU benchmark suite against eager, torch.compile, Liger and TRL, and a report,
# all into OUTDIR (docs/gpu_run.md: how to run it, also split over several 10-minute device calls).
#
#   bash benchmarks/run_gpu.sh [--only STEPS] [--skip STEPS] [--budget SECONDS] [--rebuild] [--dry-run] OUTDIR
#
# Steps, in this order (default: all but alltests):
#   env          OUTDIR/env.{json,md}, nvidia-smi.txt: device, driver, torch/triton/CUDA/nvcc versions, peers
#   build        grpo_kernels/_C in place (GRPO_KERNELS_BUILD_CUDA=1 python setup.py build_ext --inplace), for this
#                GPU's architecture; a copy and the sources' hash go to OUTDIR/build, and a later call whose OUTDIR
#                holds them (carried) reuses that build instead of compiling again
#   tests        pytest -m cuda (the cuda-marked tests), OUTDIR/tests/cuda.xml
#   alltests     the whole test suite on the GPU, OUTDIR/tests/all.xml (only when named in --only)
#   parity       python -m benchmarks.gpu_parity: torch, triton, cuda against the float64 oracle, V = 151,936,
#                N = 16,384, bf16/fp16/fp32, fwd + bwd; OUTDIR/parity/parity.{json,md}; fails on any excess
#   bench_grpo_loss, bench_fused_linear, bench_token_logprobs  (the group "bench")
#                pytest --bench-size gpu, one file each, OUTDIR/bench/<step>.json; -rs prints every skip reason
#                (a peer that is not installed is skipped with a line saying so)
#   interleaved  python -m benchmarks.interleaved: ours against TRL 1.16 on the TRL case, OUTDIR/bench/interleaved-trl.*
#   lean_memory  python -m benchmarks.lean_memory --device cuda: the fused lm_head + loss, memory="fast" against
#                memory="lean" (bf16, B·T = 8,192, H = 4,096, V = 151,936): peak extra memory against the bf16
#                gradients, time against the bare lm_head GEMMs; OUTDIR/bench/lean_memory.json
#   packing      python -m benchmarks.packing_step --size gpu: a trainer step padding-free (flash-attn's varlen kernels
#                when installed, else SDPA per sequence) against padded, lengths 10-100% of the budget;
#                OUTDIR/bench/packing.{json,md}
#   vllm_train   python -m benchmarks.vllm_train: a 3-step training with --rollout vllm on a small Llama written to
#                OUTDIR/vllm (summary.json, train.log); skipped, and said so, when vllm is not importable
#   report       OUTDIR/bench/benchmarks.{json,md} and plots, OUTDIR/SUMMARY.md
# Options:
#   --only a,b   only these steps (and groups)     --skip a,b   all selected steps but these
#   --budget S   seconds for this whole call (default 1500); every step has its own timeout too, cut to what is
#                left; a step that cannot start with its minimum left is skipped and named in OUTDIR/skipped.txt;
#                60 s stay reserved for the report when it is selected
#   --rebuild    compile the extension even when OUTDIR/build holds one for these sources and this torch
#   --dry-run    print every command; run the CPU-checkable steps on the CPU at tiny sizes (env, parity at smoke
#                size on the torch backend, the suites at --bench-size smoke --benchmark-disable, interleaved at
#                smoke size for the fused lm_head, report); no GPU needed
# Environment: PYTHON (default python3), WHEELS (a folder of wheels, e.g. trl and liger-kernel, installed with
#   pip --no-index --no-deps into /tmp/grpo_gpu_site first), GPU_RUN_BENCH_K (a pytest -k expression for the
#   suites), TORCH_CUDA_ARCH_LIST (default: this GPU's capability), MAX_JOBS (default: the CPU count).
# Exit status: 0 when every step that ran passed, 1 when one failed or timed out, 2 on bad usage or no GPU.

set -uo pipefail

ALL_STEPS=(env build tests alltests parity bench_grpo_loss bench_fused_linear bench_token_logprobs interleaved lean_memory
    packing vllm_train report)
declare -A TIMEOUT=([env]=120 [build]=900 [tests]=600 [alltests]=1500 [parity]=900 [bench_grpo_loss]=480
    [bench_fused_linear]=600 [bench_token_logprobs]=480 [interleaved]=300 [report]=180)
declare -A MINIMUM=([env]=10 [build]=120 [tests]=30 [alltests]=120 [parity]=90 [bench_grpo_loss]=60
    [bench_fused_linear]=60 [bench_token_logprobs]=60 [interleaved]=60 [report]=10)

usage() { sed -n '2,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

ONLY="" SKIP="" BUDGET=1500 REBUILD=0 DRY=0 OUTDIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        --only) ONLY="${2:?--only needs a list}"; shift 2 ;;
        --skip) SKIP="${2:?--skip needs a list}"; shift 2 ;;
        --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
        --rebuild) REBUILD=1; shift ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) usage 0 ;;
        -*) echo "run_gpu.sh: unknown option $1" >&2; usage ;;
        *) [ -z "$OUTDIR" ] || { echo "run_gpu.sh: one OUTDIR, got $OUTDIR and $1" >&2; exit 2; }; OUTDIR="$1"; shift ;;
    esac
done
[ -n "$OUTDIR" ] || { echo "run_gpu.sh: OUTDIR is missing" >&2; usage; }
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "run_gpu.sh: --budget takes whole seconds, got $BUDGET" >&2; exit 2; }
mkdir -p "$OUTDIR" && OUTDIR="$(cd "$OUTDIR" && pwd)"
if [ -n "${WHEELS:-}" ]; then
    WHEELS="$(cd "$WHEELS" 2>/dev/null && pwd)" || { echo "run_gpu.sh: WHEELS is not a folder" >&2; exit 2; }
fi
cd "$(dirname "$0")/.." && REPO="$PWD"

expand() {  # a comma list of steps and groups -> one step a line
    local name
    for name in ${1//,/ }; do
        if [ "$name" = bench ]; then printf '%s\n' bench_grpo_loss bench_fused_linear bench_token_logprobs
        elif [[ " ${ALL_STEPS[*]} " == *" $name "* ]]; then echo "$name"
        else echo "run_gpu.sh: unknown step $name (steps: ${ALL_STEPS[*]}; group: bench)" >&2; return 1
        fi
    done
}
TIMEOUT[vllm_train]=420 MINIMUM[vllm_train]=90
TIMEOUT[lean_memory]=300 MINIMUM[lean_memory]=60
TIMEOUT[packing]=600 MINIMUM[packing]=60
WANTED="$(expand "${ONLY:-env,build,tests,parity,bench,interleaved,lean_memory,packing,vllm_train,report}")" || exit 2
UNWANTED="$(expand "$SKIP")" || exit 2
STEPS=()
for step in "${ALL_STEPS[@]}"; do
    if grep -qx "$step" <<<"$WANTED" && ! grep -qx "$step" <<<"$UNWANTED"; then STEPS+=("$step"); fi
done

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR/logs" "$OUTDIR/build" "$OUTDIR/bench" "$OUTDIR/tests"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
RESERVE=0
[[ " ${STEPS[*]} " == *" report "* ]] && RESERVE=60
FAILED=() SKIPPED=()

quote() { printf '%q ' "$@"; }
say() { echo "run_gpu.sh: $*"; }
say "steps: ${STEPS[*]:-none}; budget ${BUDGET} s; OUTDIR $OUTDIR$([ "$DRY" = 1 ] && echo '; DRY RUN')"

if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "run_gpu.sh: no CUDA device is visible to $PY (torch: $("$PY" -c 'import torch; print(torch.__version__)' 2>&1));" \
        "use --dry-run on a machine without a GPU" >&2
    exit 2
fi

if [ -n "${WHEELS:-}" ]; then  # carried peers (trl, liger-kernel and what they need that the machine lacks)
    cmd=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/grpo_gpu_site)
    say "wheels: + $(quote "${cmd[@]}") $WHEELS/*.whl"
    if [ "$DRY" = 0 ]; then
        "${cmd[@]}" "$WHEELS"/*.whl 2>&1 | tee "$OUTDIR/logs/wheels.log" || say "wheels: pip failed (see logs/wheels.log)"
        export PYTHONPATH="$PYTHONPATH:/tmp/grpo_gpu_site"
    fi
fi

build_stamp() {  # the sources' hash and the torch it is built against
    local sources
    sources="$(find csrc -maxdepth 1 -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' \) | sort)"
    echo "$(cat $sources setup.py | sha256sum | cut -c1-16) torch-$("$PY" -c 'import torch; print(torch.__version__)')"
}

reuse_build() {  # copy OUTDIR/build's extension into the tree when it was built from these sources
    local so
    so="$(ls "$OUTDIR"/build/_C*.so 2>/dev/null | head -1)"
    [ "$REBUILD" = 0 ] && [ -n "$so" ] && [ -f "$OUTDIR/build/stamp" ] || return 1
    [ "$(cat "$OUTDIR/build/stamp")" = "$(build_stamp)" ] || return 1
    cp -p "$so" grpo_kernels/ && say "extension: reusing $so (built from these sources)"
}

if [ "$DRY" = 0 ] && ! ls grpo_kernels/_C*.so >/dev/null 2>&1 && [[ " ${STEPS[*]} " != *" build "* ]]; then
    reuse_build || say "extension: none in the tree or in OUTDIR/build; backend 'cuda' will fail (run the build step)"
fi

commands() {  # GPU and CPU (dry run) command of step $1; an empty CPU one: not CPU-checkable
    local k=()
    [ -n "${GPU_RUN_BENCH_K:-}" ] && k=(-k "$GPU_RUN_BENCH_K")
    CPU=()
    case "$1" in
        env) GPU=("$PY" -m benchmarks.gpu_run env "$OUTDIR"); CPU=("${GPU[@]}") ;;
        build)
            local arch="${TORCH_CUDA_ARCH_LIST:-}"
            [ -n "$arch" ] || [ "$DRY" = 1 ] || arch="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
            GPU=(env "TORCH_CUDA_ARCH_LIST=${arch:-<this GPU>}" "MAX_JOBS=${MAX_JOBS:-$(nproc)}" GRPO_KERNELS_BUILD_CUDA=1
                "$PY" setup.py build_ext --inplace) ;;
        tests) GPU=("$PY" -m pytest -m cuda -rs -q -p no:cacheprovider tests --junitxml "$OUTDIR/tests/cuda.xml") ;;
        alltests) GPU=("$PY" -m pytest -rs -q -p no:cacheprovider tests --junitxml "$OUTDIR/tests/all.xml") ;;
        parity)
            GPU=("$PY" -m benchmarks.gpu_parity --out "$OUTDIR/parity")
            CPU=("$PY" -m benchmarks.gpu_parity --size smoke --backends torch --out "$OUTDIR/parity") ;;
        bench_*)
            local suite=(-m pytest "benchmarks/$1.py" -rs -q -p no:cacheprovider -p benchmarks.gpu_run "${k[@]}")
            GPU=("$PY" "${suite[@]}" --bench-size gpu --benchmark-json "$OUTDIR/bench/$1.json")
            CPU=("$PY" "${suite[@]}" --bench-size smoke --benchmark-disable) ;;
        interleaved)
            GPU=("$PY" -m benchmarks.interleaved --out "$OUTDIR/bench/interleaved-trl.json")
            CPU=("$PY" -m benchmarks.interleaved --size smoke --rounds 1 --benches fused_linear
                --out "$OUTDIR/bench/interleaved-trl.json") ;;
        lean_memory)
            GPU=("$PY" -m benchmarks.lean_memory --device cuda --out "$OUTDIR/bench/lean_memory.json")
            CPU=("$PY" -m benchmarks.lean_memory --smoke --rounds 1 --out "$OUTDIR/bench/lean_memory.json") ;;
        packing)
            GPU=("$PY" -m benchmarks.packing_step --size gpu --out "$OUTDIR/bench/packing.json")
            CPU=("$PY" -m benchmarks.packing_step --size smoke --rounds 1 --out "$OUTDIR/bench/packing.json") ;;
        vllm_train) GPU=("$PY" -m benchmarks.vllm_train "$OUTDIR/vllm") ;;
        report) GPU=("$PY" -m benchmarks.gpu_run report "$OUTDIR"); CPU=("${GPU[@]}") ;;
    esac
}

record() {  # step status exit seconds
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "logs/$1.log" "$(date -u +%FT%TZ)" >>"$OUTDIR/steps.tsv"
    case "$2" in failed*|timeout*) FAILED+=("$1 ($2)") ;; esac
}

run_step() {
    local step=$1 log="$OUTDIR/logs/$1.log" reserve=$RESERVE left limit rc began status
    commands "$step"
    [ "$step" = report ] && reserve=0
    left=$((DEADLINE - $(date +%s) - reserve))
    echo
    say "=== $step ==="
    if [ "$left" -lt "${MINIMUM[$step]}" ]; then
        echo "$step: skipped, out of time (${left} s left of the budget, it needs ${MINIMUM[$step]} s): $(quote "${GPU[@]}")" \
            | tee -a "$OUTDIR/skipped.txt"
        SKIPPED+=("$step")
        record "$step" "skipped (out of time)" - 0
        return
    fi
    limit=$((left < TIMEOUT[$step] ? left : TIMEOUT[$step]))
    say "+ $(quote "${GPU[@]}")  # timeout ${limit} s"
    if [ "$step" = vllm_train ] && [ "$DRY" = 0 ] && ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
        echo "$step: skipped, vllm is not importable by $PY" | tee "$log"
        record "$step" "skipped (vllm not installed)" - 0
        return
    fi
    if [ "$DRY" = 1 ]; then
        if [ ${#CPU[@]} -eq 0 ]; then
            echo "dry run: not run here (needs the GPU)" | tee "$log"
            record "$step" "dry run: printed" - 0
            return
        fi
        say "dry run, on the CPU: + $(quote "${CPU[@]}")"
        GPU=("${CPU[@]}")
    fi
    if [ "$step" = build ] && [ "$DRY" = 0 ] && reuse_build; then
        record build "ok (reused)" 0 0
        return
    fi
    began=$(date +%s)
    timeout -s INT -k 30 "$limit" "${GPU[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$step" = build ] && [ "$DRY" = 0 ] && [ "$rc" = 0 ]; then
        rm -f "$OUTDIR"/build/_C*.so
        cp -p grpo_kernels/_C*.so "$OUTDIR/build/" && build_stamp >"$OUTDIR/build/stamp"
        "$PY" -c 'import torch, grpo_kernels._C; print("loaded:", torch.ops.grpo_kernels.token_logprobs_fwd)' 2>&1 \
            | tee -a "$log"
        rc=${PIPESTATUS[0]}
    fi
    case "$rc" in
        0) status=ok ;;
        5) if [ "$step" = tests ]; then status="ok (no cuda-marked tests collected)"; else status="failed"; fi ;;
        124|137) status="timeout (after ${limit} s)" ;;
        *) status="failed" ;;
    esac
    record "$step" "$status" "$rc" $(($(date +%s) - began))
    say "$step: $status ($(($(date +%s) - began)) s)"
}

for step in "${STEPS[@]}"; do run_step "$step"; done

echo
say "=== summary ($(($(date +%s) - START)) s of ${BUDGET} s) ==="
column -t -s $'\t' "$OUTDIR/steps.tsv" 2>/dev/null || cat "$OUTDIR/steps.tsv"
[ ${#SKIPPED[@]} -eq 0 ] || say "skipped for lack of time: ${SKIPPED[*]} (run them in another call: --only $(IFS=,; echo "${SKIPPED[*]}"))"
if [ ${#FAILED[@]} -gt 0 ]; then
    say "FAILED: ${FAILED[*]} (logs in $OUTDIR/logs)"
    exit 1
fi
say "results in $OUTDIR (SUMMARY.md)"
