#!/usr/bin/env bash
# What a session with a CUDA card runs. The default steps fit one call of under 9 minutes (each step has its own
# time limit; their sum is 530 s): the machine, the rehearsal of 2 cards on card 0, the CUDA tests (those not marked
# slow or rehearse), and the main job's timeline on the card over 3 seeds. The other steps are named to run them
# (deterministic: deterministic mode's cost and repeatability, measured 2026-11-26).
# rehearse: 2 processes on card 0 over gloo (--devices 0,0). First the probe (benchmarks/rehearse_probe.py: a line
# per stage, a time limit per stage, then whether NCCL takes them), then the rehearsal tests (pytest -m rehearse:
# parity of ddp and fsdp, the user's loop), the user's loop through `multicard run --devices 0,0`, and `multicard
# train --devices 0,0`; each part has a time limit of its own, and runs whether or not the parts before it passed
# (a probe that fails at fsdp says nothing of ddp); the step fails if any part does.
# Everything is written under OUT (default runs/on-a-card): a log per step, the JSON of each benchmark, the runs'
# folders, and every temporary file (TMPDIR, pytest's, torch.compile's and Triton's caches, matplotlib's).
# A step whose command fails (a Python line that raised included) is reported failed, and so is the script.
# It runs from a checkout without installing multicard (PYTHONPATH=src), on whatever torch the machine has.
# Usage: benchmarks/on_a_card.sh [OUT] [STEP ...]
#   default: env rehearse cuda-tests timeline
#   more:    deterministic cuda-slow autotune suite train main-job loop tax graphs bench bench-bf16 bench-resnet8
set -u
out=$(mkdir -p "${1:-runs/on-a-card}" && cd "${1:-runs/on-a-card}" && pwd); shift || true
steps=${*:-env rehearse cuda-tests timeline}
mkdir -p "$out/tmp" "$out/runs"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR="$out/tmp" MPLCONFIGDIR="$out/tmp/matplotlib" TRITON_CACHE_DIR="$out/tmp/triton" \
    TORCHINDUCTOR_CACHE_DIR="$out/tmp/inductor"
py=${PYTHON:-python3}
mc="$py -m multicard"
tests="$py -m pytest -p no:cacheprovider --basetemp=$out/tmp/pytest -rs --durations=15"
failed=0
step() {  # step NAME SECONDS COMMAND...: run, log to $out/NAME.txt, say how it ended
    local name=$1 limit=$2; shift 2
    local begin=$SECONDS code
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    code=$?
    if [ $code -eq 0 ]; then
        echo "step $name: ok in $((SECONDS - begin)) s" | tee -a "$out/steps.txt"
    else
        failed=1
        echo "step $name: FAILED (exit $code$([ $code -eq 124 ] && echo ", over its ${limit} s")) in" \
            "$((SECONDS - begin)) s; see $out/$name.txt" | tee -a "$out/steps.txt"
    fi
}
bench() {  # bench NAME SECONDS FLAGS...: a bench sweep, its reports flat next to the logs
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" $mc bench --out "$out/runs/$name" "$@"
    for f in bench.json bench.md bench.png; do cp "$out/runs/$name/$f" "$out/$name.${f#bench.}" 2>/dev/null; done
}
known=" env rehearse cuda-tests timeline deterministic cuda-slow autotune suite train main-job loop tax graphs bench \
bench-bf16 bench-resnet8 "
for s in $steps; do  # every name checked before anything runs: a typo costs no card time
    case $known in *" $s "*) ;; *) echo "unknown step $s (steps:$known)" >&2; exit 2;; esac
done
for s in $steps; do
    case $s in
    env) step env 30 bash -ec "date -u; nvidia-smi; $py -c 'import sys, torch; print(sys.version); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; \
git log -1 --format=%H 2>/dev/null || echo 'not a git checkout'";;
    rehearse) step rehearse 180 bash -c "f=0; echo '== probe'; \
timeout 75 $py benchmarks/rehearse_probe.py --devices cuda:0 --nccl --start-timeout 40 --stage-timeout 20 || f=1; \
echo '== pytest -m rehearse'; timeout 80 $tests -v -m 'cuda and rehearse' || f=1; \
echo '== multicard run'; timeout 40 $mc run --devices 0,0 examples/mnist_your_loop.py --epochs 1 || f=1; \
echo '== multicard train'; $mc train --devices 0,0 --out $out/runs/rehearse-train || f=1; exit \$f";;
    # -v: a log cut short still names each test
    cuda-tests) step cuda-tests 240 $tests -v -m "cuda and not slow and not rehearse";;
    cuda-slow) step cuda-slow 300 $tests -v -m "cuda and slow";;
    timeline) step timeline 80 $py benchmarks/timeline.py --card --out "$out/timeline_card.json";;
    deterministic) step deterministic 150 bash -ec "$py benchmarks/timeline.py --card --seeds 0,0 \
--out $out/timeline_card_seed0.json; $py benchmarks/timeline.py --card --seeds 0,0 \
--out $out/timeline_card_deterministic.json -- --deterministic";;
    autotune) step autotune 120 $py benchmarks/timeline.py --card --cudnn-benchmark \
--out "$out/timeline_card_cudnn_benchmark.json";;
    suite) step suite 300 $tests -q;;
    train) step train 300 bash -ec "for s in single dp dp-balanced ddp; do \
$mc train --strategy \$s --devices 1 --out $out/runs/train-\$s; done";;
    main-job) step main-job 300 $py benchmarks/main_job.py --card --out "$out/main_job_card.json";;
    loop) step loop 400 bash -ec "$py benchmarks/loop_vs_plain.py --device cuda --out $out/loop_vs_plain_card.json; \
$py benchmarks/loop_vs_plain.py --device cuda --model tiny --out $out/loop_vs_plain_card_tiny.json";;
    tax) step tax 400 bash -ec "$py benchmarks/strategy_tax.py --device cuda --model lenet5 \
--out $out/strategy_tax_card.json; $py benchmarks/strategy_tax.py --device cuda --model tiny \
--out $out/strategy_tax_card_tiny.json";;
    graphs) step graphs 400 bash -ec "set -o pipefail; \
for extra in '' '--compile' '--compile --compile-mode reduce-overhead'; do echo \"== batch 64 \$extra\"; \
$mc train --devices 1 --batch-size 64 --device-data --out $out/runs/graphs \$extra | tail -2; done";;
    bench) bench bench 400;;
    bench-bf16) bench bench-bf16 300 --precision bf16 --compile --no-baseline --strategies single --devices 1;;
    bench-resnet8) bench bench-resnet8 400 --model resnet8;;
    esac
done
exit $failed
