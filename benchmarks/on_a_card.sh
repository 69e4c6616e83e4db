#!/usr/bin/env bash
# What a session with a CUDA card runs, in one go: the machine, the CUDA tests, the whole suite, the main job on
# the card, and the bench sweeps. Logs and bench reports go to $1 (default runs/on-a-card), one file per step.
# It runs from a checkout without installing multicard (PYTHONPATH=src), on whatever torch the machine has.
# Usage: benchmarks/on_a_card.sh [OUT] [STEP ...]
#   steps: env cuda-tests suite train main-job loop tax graphs bench bench-bf16 bench-resnet8
#   (issue 14's figures: main-job, loop, tax, graphs and bench; each writes its JSON into OUT)
set -u
out=${1:-runs/on-a-card}; shift || true
steps=${*:-env cuda-tests suite train main-job loop tax graphs bench bench-bf16 bench-resnet8}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mc="$py -m multicard"
step() {  # step NAME SECONDS COMMAND...: run, log to $out/NAME.txt, say how it ended
    local name=$1 limit=$2; shift 2
    local begin=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "step $name: exit $? in $((SECONDS - begin)) s" | tee -a "$out/steps.txt"
}
bench_copy() {  # keep a bench's three reports, flat, next to the logs
    for f in bench.json bench.md bench.png; do cp "/tmp/$1/$f" "$out/$1.${f#bench.}" 2>/dev/null; done
}
for s in $steps; do
    case $s in
    env) step env 60 bash -c "date -u; nvidia-smi; $py -c 'import sys, torch; print(sys.version); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; git log -1 --format=%H 2>/dev/null";;
    cuda-tests) step cuda-tests 300 $py -m pytest -p no:cacheprovider -m cuda -v -rs;;
    suite) step suite 240 $py -m pytest -p no:cacheprovider -q -rs;;
    train) step train 300 bash -c "$mc train --devices 1 --out /tmp/train-single && \
$mc train --strategy dp --devices 1 --out /tmp/train-dp && $mc train --strategy dp-balanced --devices 1 --out /tmp/train-bal && \
$mc train --strategy ddp --devices 1 --out /tmp/train-ddp";;
    main-job) step main-job 300 $py benchmarks/main_job.py --card --out "$out/main_job_card.json";;
    loop) step loop 400 bash -c "$py benchmarks/loop_vs_plain.py --device cuda --out $out/loop_vs_plain_card.json && \
$py benchmarks/loop_vs_plain.py --device cuda --model tiny --out $out/loop_vs_plain_card_tiny.json";;
    tax) step tax 400 bash -c "$py benchmarks/strategy_tax.py --device cuda --model lenet5 --out $out/strategy_tax_card.json && \
$py benchmarks/strategy_tax.py --device cuda --model tiny --out $out/strategy_tax_card_tiny.json";;
    graphs) step graphs 400 bash -c "for extra in '' '--compile' '--compile --compile-mode reduce-overhead'; do \
echo \"== batch 64 \$extra\"; $mc train --devices 1 --batch-size 64 --device-data --out /tmp/graphs \$extra | tail -2; done";;
    bench) rm -rf /tmp/bench-gpu; step bench 400 $mc bench --out /tmp/bench-gpu; bench_copy bench-gpu;;
    bench-bf16) rm -rf /tmp/bench-gpu-bf16; step bench-bf16 300 $mc bench --out /tmp/bench-gpu-bf16 --precision bf16 \
--compile --no-baseline --strategies single --devices 1; bench_copy bench-gpu-bf16;;
    bench-resnet8) rm -rf /tmp/bench-gpu-resnet8; step bench-resnet8 400 $mc bench --out /tmp/bench-gpu-resnet8 \
--model resnet8; bench_copy bench-gpu-resnet8;;
    *) echo "unknown step $s" >&2; exit 2;;
    esac
done
