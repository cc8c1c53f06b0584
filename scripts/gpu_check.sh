#!/usr/bin/env bash
# The GPU checks behind the README's GPU figures, on a machine with an NVIDIA GPU and PyTorch:
#   scripts/gpu_check.sh tests   the CUDA test module (and the graph buffers' tests)
#   scripts/gpu_check.sh bench   SmolLM2 on the GPU: Spec-Bench per method with transformers' greedy
#                                output compared; a profile of decoding's kernels; bench-serve; decode
#                                speed against transformers (eager, and static cache + torch.compile)
#                                and the bandwidth bound
#   scripts/gpu_check.sh specbench    the first of these alone
#   scripts/gpu_check.sh runtime      the last of these alone (decode speed and bounds)
#   scripts/gpu_check.sh shape SRC    the same on random weights in the shape of the model directory
#                                     SRC (config.json and tokenizer: scripts/random_weights.py), for
#                                     a model whose weights cannot travel to the GPU
# Logs and JSON go to $OUT (default ./gpu-out). MODEL (default smollm2-135m) names the model,
# QUESTIONS the Spec-Bench file (default ../shared/data/spec_bench/question.jsonl).
set -uo pipefail
OUT=${OUT:-gpu-out}
MODEL=${MODEL:-smollm2-135m}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
runtime() {  # model, JSON name: decode speed against transformers (compiling it takes minutes)
    timeout "${COMPILE_S:-150}" $py -m specdecode.cli bench-runtime --model "$1" --device cuda \
        --dtype bfloat16 --new-tokens 256 --repeats 3 --compile --json "$OUT/$2" 2>&1 | tee "$OUT/${2%.json}.log"
}
questions=(--questions "${QUESTIONS:-../shared/data/spec_bench/question.jsonl}")
specbench() {  # every method on one turn per category, transformers' greedy output compared
    methods=(--method prompt_lookup --method lookahead --method eagle2 --method eagle --method medusa --method redrafter)
    timeout "${SPECBENCH_S:-150}" $py -m specdecode.cli bench --model "$MODEL" --device cuda --dtype bfloat16 \
        --per-category 1 --max-tokens 128 --transformers "${methods[@]}" "${questions[@]}" \
        --json "$OUT/specbench.json" --plot "$OUT/specbench.png" 2>&1 | grep -v "spec-bench:" | tee "$OUT/specbench.log"
}
case "${1:-}" in
specbench)
    specbench
    ;;
runtime)
    runtime "$MODEL" runtime.json
    ;;
shape)
    $py scripts/random_weights.py "$2" /tmp/random-model --dtype bfloat16 --device cuda 2>&1 | tail -1
    runtime /tmp/random-model runtime_shape.json
    ;;
tests)
    timeout "${TESTS_S:-240}" $py -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_cuda.py tests/test_graphs.py 2>&1 \
        | tee "$OUT/tests.log"
    ;;
bench)
    # In order of what the figures need most; each step has its own limit, and the last runs only
    # where BUDGET_S (default 480) seconds have not yet passed.
    specbench
    timeout 60 $py scripts/gpu_profile.py --model "$MODEL" --device cuda --dtype bfloat16 --tokens 64 2>&1 \
        | tee "$OUT/profile.log"
    timeout 60 $py -m specdecode.cli bench-serve --model "$MODEL" --device cuda --dtype bfloat16 \
        --streams 1,16,64 --max-tokens 32 --spec '{"method": "prompt_lookup"}' "${questions[@]}" \
        --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log"
    runtime "$MODEL" runtime.json
    left=$((${BUDGET_S:-480} - SECONDS))
    if ((left > 30)); then
        timeout "$left" $py -m specdecode.cli bench --model "$MODEL" --device cuda --dtype bfloat16 \
            --per-category 1 --max-tokens 128 --no-policy --method prompt_lookup --method eagle2 --method medusa \
            --method redrafter "${questions[@]}" --json "$OUT/specbench_nopolicy.json" 2>&1 \
            | grep -v "spec-bench:" | tee "$OUT/specbench_nopolicy.log"
    fi
    ;;
*)
    echo "usage: $0 tests|bench|specbench|runtime|shape SRC" >&2
    exit 2
    ;;
esac
