#!/usr/bin/env bash
# One command for a GPU: the CUDA extension, the cuda-marked tests (torch.library.opcheck included), every backend
# against the float64 oracle at real sizes, the headline step against the bare GEMMs, TRL, Liger and eager, the
# benchmark suites, and a report, all into OUTDIR (default benchmarks/results/<device>/<plan, or run>; a dry run
# needs one). docs/gpu_run.md.
#
#   bash benchmarks/run_gpu.sh [--plan first|second] [--only STEPS] [--skip STEPS] [--budget SECONDS] [--rebuild]
#                              [--dry-run] [OUTDIR]
#
# Plans: two calls that fit 15 minutes of GPU time with the machine's start-up. Each step has a timeout; the sum of a
# plan's timeouts is its bound (--dry-run prints both plans' steps, timeouts and sums):
#   first  (480 s)  env 20, build 35, tests 50 (-m cuda, opcheck), parity 130 (triton and cuda, bf16 and fp32),
#                   headline 155, host 30, compiled 40, report 20
#   second (240 s)  env 15, the three bench suites at --bench-size gpu-short (40 + 55 + 35), lean_memory 30,
#                   packing 30, replay 25, report 10 (its sum is the bound: mismatch, divergence and one_pass are
#                   in the full run only)
# Without --plan: every step but alltests, at the full sizes, within --budget (default 1500 s): the full suites.
# Steps, in this order:
#   env          OUTDIR/env.{json,md}, nvidia-smi.txt: device, driver, torch/triton/CUDA/nvcc versions, peers
#   build        grpo_kernels/_C in place (GRPO_KERNELS_BUILD_CUDA=1 python setup.py build_ext --inplace), for this
#                GPU's architecture; a copy and the sources' hash go to OUTDIR/build, and a later call whose OUTDIR
#                holds them (carried) reuses that build instead of compiling again
#   tests        pytest -m cuda (the cuda-marked tests, opcheck of every custom op among them), OUTDIR/tests/cuda.xml
#   alltests     the whole test suite on the GPU, OUTDIR/tests/all.xml (only when named in --only)
#   parity       python -m benchmarks.gpu_parity: the backends against the float64 oracle and a plain same-dtype
#                implementation, V = 151,936, N = 16,384, fwd + bwd (plan first: triton and cuda, bf16 and fp32;
#                else torch, triton, cuda at bf16/fp16/fp32); OUTDIR/parity/parity.{json,md}; fails on any excess
#   headline     python -m benchmarks.headline: the fused lm_head step against the bare GEMMs, TRL, Liger and eager at
#                N 8,192 and 16,384 (bf16, H 4,096, V 151,936), time and peak memory, the vocabulary kernels'
#                bandwidth; OUTDIR/headline/headline.{json,md}
#   host         python -m benchmarks.host_overhead --device cuda --backend triton: each public function's wall time
#                per call at tiny shapes against its device time (torch.profiler), ops per call;
#                OUTDIR/host/host.{json,md}
#   compiled     python -m benchmarks.compiled_step: the public API on the Triton backend, eager against
#                torch.compile(mode="reduce-overhead") (a CUDA graph), at N 8,192 (bf16, V 151,936): wall time per
#                call against the kernels' time, i.e. the API's share of the kernels' bandwidth, for token_logprobs
#                forward and grpo_loss forward + backward; OUTDIR/compiled/compiled_step.{json,md}
#   bench_grpo_loss, bench_fused_linear, bench_token_logprobs  (the group "bench")
#                pytest --bench-size gpu (plan second: gpu-short), one file each, OUTDIR/bench/<step>.json; -rs
#                prints every skip reason (a peer that is not installed is skipped with a line saying so)
#   interleaved  python -m benchmarks.interleaved: ours against TRL 1.16 on the TRL case, OUTDIR/bench/interleaved-trl.*
#   lean_memory  python -m benchmarks.lean_memory --device cuda: the fused lm_head + loss, memory="fast" against
#                memory="lean" (bf16, B·T = 8,192, H = 4,096, V = 151,936): peak extra memory against the bf16
#                gradients, time against the bare lm_head GEMMs; OUTDIR/bench/lean_memory.json
#   packing      python -m benchmarks.packing_step --size gpu: a trainer step padding-free (flash-attn's varlen kernels
#                when installed, else SDPA per sequence) against padded, lengths 10-100% of the budget;
#                OUTDIR/bench/packing.{json,md}
#   replay       python -m benchmarks.sampling_replay: the fused lm_head + loss with sampling replay (rule, min-p,
#                kept-set) against the plain step, time and peak memory (bf16, N 8,192, H 4,096, V 151,936);
#                OUTDIR/bench/sampling_replay.{json,md}
#   mismatch     pytest benchmarks/bench_mismatch.py --bench-size gpu: the fused step with the heaviest rollout
#                correction against the plain step (bf16, N 8,192, H 4,096, V 151,936), and the [B, T] correction
#                against verl's rollout_corr_helper (B 256, T 4,096, host syncs counted); OUTDIR/bench/mismatch.json
#   divergence   pytest benchmarks/bench_divergence.py --bench-size gpu: fused_linear_divergence against TRL's
#                ChunkedDivergenceFunction and Liger's LigerFusedLinearJSD (fp32, N 2,048, H 896, V 151,936, beta 1
#                and 0.5), peak memory from a fresh process per case; and bench_teacher_term.py: the GRPO step with
#                the teacher term against the plain step (fp32, N 2,048, H 896, V 151,936); OUTDIR/bench/divergence.json
#   one_pass     pytest benchmarks/bench_one_pass.py --bench-size gpu: the trainer's training phase with the update
#                as its own pi_old pass against a separate pi_old pass (a 2-layer Qwen2, H 896, V 151,936, 32 rows of
#                640 tokens); OUTDIR/bench/one_pass.json
#   vllm_mask    python -m benchmarks.vllm_sampling_mask: kept-set replay on vLLM's own sampling masks
#                (return_sampling_mask) against its processed log-probs, a small Llama in fp32; OUTDIR/vllm_mask;
#                skipped, and said so, when vllm is not importable
#   vllm_train   python -m benchmarks.vllm_train: a 3-step training with --rollout vllm on a small Llama written to
#                OUTDIR/vllm (summary.json, train.log); skipped, and said so, when vllm is not importable
#   report       OUTDIR/bench/benchmarks.{json,md} and plots, OUTDIR/SUMMARY.md
# Options:
#   --plan P     the steps and timeouts of plan P (first or second); --only/--skip narrow it
#   --only a,b   only these steps (and groups)     --skip a,b   all selected steps but these
#   --budget S   seconds for this whole call (default 1500; with --plan, the plan's sum); every step has its own
#                timeout too, cut to what is left; a step that cannot start with its minimum left is skipped and
#                named in OUTDIR/skipped.txt; the report's timeout stays reserved for it when it is selected
#   --rebuild    compile the extension even when OUTDIR/build holds one for these sources and this torch
#   --dry-run    print both plans and every command; run the CPU-checkable steps on the CPU at tiny sizes (env,
#                parity at smoke size on the torch backend, headline at smoke size, host on the CPU, compiled at
#                smoke size (Triton's interpreter, the aot_eager compiler), the suites, mismatch, divergence and
#                one_pass at --bench-size smoke --benchmark-disable, interleaved at smoke size for the fused lm_head,
#                lean_memory, packing and replay at smoke size, report); no GPU needed
# Environment: PYTHON (default python3), WHEELS (a folder of wheels, e.g. trl and liger-kernel, installed with
#   pip --no-index --no-deps into /tmp/grpo_gpu_site first), GPU_RUN_BENCH_K (a pytest -k expression for the
#   three suites of the group bench), TORCH_CUDA_ARCH_LIST (default: this GPU's capability), MAX_JOBS (default:
#   the CPU count).
# Exit status: 0 when every step that ran passed, 1 when one failed or timed out, 2 on bad usage or no GPU.

set -uo pipefail

ALL_STEPS=(env build tests alltests parity headline host compiled bench_grpo_loss bench_fused_linear
    bench_token_logprobs interleaved lean_memory packing replay mismatch divergence one_pass vllm_mask vllm_train
    report)
declare -A TIMEOUT=([env]=120 [build]=900 [tests]=600 [alltests]=1500 [parity]=900 [headline]=600
    [bench_grpo_loss]=480 [bench_fused_linear]=600 [bench_token_logprobs]=480 [interleaved]=300 [report]=180)
declare -A MINIMUM=([env]=10 [build]=30 [tests]=30 [alltests]=120 [parity]=90 [headline]=60 [bench_grpo_loss]=30
    [bench_fused_linear]=30 [bench_token_logprobs]=30 [interleaved]=60 [report]=10)
TIMEOUT[vllm_train]=420 MINIMUM[vllm_train]=90
TIMEOUT[lean_memory]=300 MINIMUM[lean_memory]=30
TIMEOUT[packing]=600 MINIMUM[packing]=30
TIMEOUT[host]=120 MINIMUM[host]=15
TIMEOUT[compiled]=300 MINIMUM[compiled]=20
TIMEOUT[replay]=300 MINIMUM[replay]=20
TIMEOUT[mismatch]=300 MINIMUM[mismatch]=20
TIMEOUT[divergence]=300 MINIMUM[divergence]=30
TIMEOUT[one_pass]=300 MINIMUM[one_pass]=30
TIMEOUT[vllm_mask]=300 MINIMUM[vllm_mask]=90
# The plans: "step:timeout" in order. Measured on an H100 (2026-11-26): env ~10 s, build 19 s, pytest -m cuda 22 s,
# gpu_parity triton bf16+fp32 35 s (the cuda backend and the plain implementation come on top), the fused step ~25 s.
# compiled has not run on a GPU yet: its 40 s (two graphs compiled by Inductor, their CUDA graphs recorded, the timed
# calls at ~1-3 ms each) come from build's and tests' margins and parity's. Plan second's sum is its 240 s bound:
# mismatch, divergence and one_pass run in the full run only.
PLAN_FIRST="env:20 build:35 tests:50 parity:130 headline:155 host:30 compiled:40 report:20"
PLAN_SECOND="env:15 bench_grpo_loss:40 bench_fused_linear:55 bench_token_logprobs:35 lean_memory:30 packing:30 replay:25"
PLAN_SECOND+=" report:10"

usage() { sed -n '2,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

ONLY="" SKIP="" BUDGET="" REBUILD=0 DRY=0 OUTDIR="" PLAN=""
while [ $# -gt 0 ]; do
    case "$1" in
        --plan) PLAN="${2:?--plan needs first or second}"; shift 2 ;;
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
case "$PLAN" in
    "") PLAN_STEPS="" ;;
    first) PLAN_STEPS="$PLAN_FIRST" ;;
    second) PLAN_STEPS="$PLAN_SECOND" ;;
    *) echo "run_gpu.sh: --plan takes first or second, got $PLAN" >&2; exit 2 ;;
esac
plan_table() {  # name "step:timeout ...": one line per step, then the sum
    local name=$1 item sum=0
    printf 'plan %s:' "$name"
    for item in $2; do printf ' %s %s s,' "${item%%:*}" "${item#*:}"; sum=$((sum + ${item#*:})); done
    printf ' sum %s s\n' "$sum"
}
plan_sum() { local item sum=0; for item in $1; do sum=$((sum + ${item#*:})); done; echo "$sum"; }
if [ -n "$PLAN" ]; then
    for item in $PLAN_STEPS; do TIMEOUT[${item%%:*}]=${item#*:}; done
    BUDGET="${BUDGET:-$(plan_sum "$PLAN_STEPS")}"
fi
BUDGET="${BUDGET:-1500}"
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "run_gpu.sh: --budget takes whole seconds, got $BUDGET" >&2; exit 2; }
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
if [ -z "$OUTDIR" ]; then  # benchmarks/results/<device>/<plan>; a dry run names its own
    device=""
    [ "$DRY" = 1 ] || device="$("$PY" -c 'import re, torch
print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))' 2>/dev/null)" || device=""
    [ -n "$device" ] || { echo "run_gpu.sh: OUTDIR is missing (a dry run, or no CUDA device to name it after)" >&2; usage; }
    OUTDIR="$(dirname "$0")/results/$device/${PLAN:-run}"
fi
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
DEFAULT_STEPS="env,build,tests,parity,headline,host,compiled,bench,interleaved,lean_memory,packing,replay,mismatch"
DEFAULT_STEPS+=",divergence,one_pass,vllm_mask,vllm_train,report"
[ -z "$PLAN" ] || DEFAULT_STEPS="$(for item in $PLAN_STEPS; do printf '%s,' "${item%%:*}"; done)"
WANTED="$(expand "${DEFAULT_STEPS%,}")" || exit 2
if [ -n "$ONLY" ]; then
    ONLY_STEPS="$(expand "$ONLY")" || exit 2
    WANTED="$(grep -Fx -f <(echo "$ONLY_STEPS") <<<"$WANTED" || true)"
    [ -n "$PLAN" ] || WANTED="$ONLY_STEPS"
fi
UNWANTED="$(expand "$SKIP")" || exit 2
STEPS=()
for step in "${ALL_STEPS[@]}"; do
    if grep -qx "$step" <<<"$WANTED" && ! grep -qx "$step" <<<"$UNWANTED"; then STEPS+=("$step"); fi
done

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR/logs" "$OUTDIR/build" "$OUTDIR/bench" "$OUTDIR/tests"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
RESERVE=0
[[ " ${STEPS[*]} " == *" report "* ]] && RESERVE=$((TIMEOUT[report] < 60 ? TIMEOUT[report] : 60))
FAILED=() SKIPPED=()

quote() { printf '%q ' "$@"; }
say() { echo "run_gpu.sh: $*"; }
say "steps: ${STEPS[*]:-none}; budget ${BUDGET} s${PLAN:+ (plan $PLAN)}; OUTDIR $OUTDIR$([ "$DRY" = 1 ] && echo '; DRY RUN')"
if [ "$DRY" = 1 ]; then plan_table first "$PLAN_FIRST"; plan_table second "$PLAN_SECOND"; fi

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
        headline)
            GPU=("$PY" -m benchmarks.headline --out "$OUTDIR/headline")
            CPU=("$PY" -m benchmarks.headline --size smoke --iters 1 --out "$OUTDIR/headline") ;;
        host)
            GPU=("$PY" -m benchmarks.host_overhead --device cuda --backend triton --repeats 50 --no-peers
                --json "$OUTDIR/host/host.json")
            CPU=("$PY" -m benchmarks.host_overhead --repeats 2 --warmup 1 --no-peers --json "$OUTDIR/host/host.json") ;;
        compiled)
            GPU=("$PY" -m benchmarks.compiled_step --out "$OUTDIR/compiled")
            CPU=("$PY" -m benchmarks.compiled_step --size smoke --iters 1 --rounds 1 --out "$OUTDIR/compiled") ;;
        alltests) GPU=("$PY" -m pytest -rs -q -p no:cacheprovider tests --junitxml "$OUTDIR/tests/all.xml") ;;
        parity)
            GPU=("$PY" -m benchmarks.gpu_parity --out "$OUTDIR/parity")
            [ "$PLAN" != first ] || GPU=("$PY" -m benchmarks.gpu_parity --backends triton,cuda --dtypes bf16,fp32
                --out "$OUTDIR/parity")
            CPU=("$PY" -m benchmarks.gpu_parity --size smoke --backends torch --out "$OUTDIR/parity") ;;
        bench_*|mismatch|divergence|one_pass)  # pytest-benchmark files; the suites (bench_*) take -k and gpu-short
            local files=("benchmarks/$1.py") size=gpu
            if [[ "$1" != bench_* ]]; then files=("benchmarks/bench_$1.py") k=()
            elif [ "$PLAN" = second ]; then size=gpu-short
            fi
            [ "$1" != divergence ] || files+=(benchmarks/bench_teacher_term.py)  # the GRPO step with a teacher term
            local suite=(-m pytest "${files[@]}" -rs -q -p no:cacheprovider -p benchmarks.gpu_run "${k[@]}")
            GPU=("$PY" "${suite[@]}" --bench-size "$size" --benchmark-json "$OUTDIR/bench/$1.json")
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
        replay)
            GPU=("$PY" -m benchmarks.sampling_replay --size gpu --rounds "$([ "$PLAN" = second ] && echo 2 || echo 5)"
                --out "$OUTDIR/bench/sampling_replay.json")
            CPU=("$PY" -m benchmarks.sampling_replay --size smoke --rounds 1 --out "$OUTDIR/bench/sampling_replay.json") ;;
        vllm_mask) GPU=("$PY" -m benchmarks.vllm_sampling_mask "$OUTDIR/vllm_mask") ;;
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
    if [[ "$step" = vllm_* ]] && [ "$DRY" = 0 ] && ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
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
        limit=$((limit < 300 ? 300 : limit))  # a GPU step's timeout does not fit a (shared) CPU's time
        say "dry run, on the CPU: + $(quote "${CPU[@]}")  # timeout ${limit} s"
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
