#!/usr/bin/env bash
# Every GPU check of this project, in one command, on a lent machine (one node, 1-8 GPUs):
#
#     bash benchmarks/gpu.sh [OUT_DIR]      # default OUT_DIR: benchmarks/results
#
# 1. the environment (nvidia-smi, torch, CUDA, flash-attn) -> OUT_DIR/gpu_environment.txt
# 2. the GPU-only tests (pytest -m gpu)                     -> OUT_DIR/gpu_tests.txt
# 3. the MFU sweep, llama3-1b at 8K-32K tokens, compiled blocks (issue #14: >= 50% at 32K)
#                                                           -> OUT_DIR/bench_mfu_gpu.json
# 4. the longest traced sequence on one GPU, real steps, allocator peak next to the trace
#                                                           -> OUT_DIR/bench_long_context_gpu.json
# 5. with 2+ GPUs: the Ulysses exchange against NCCL's own all-to-all at equal bytes
#    (issue #14: within 10%)                                -> OUT_DIR/bench_a2a_gpu.json
# Each step prints as it goes; a failing step is reported and the next one still runs.
set -uo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
status=0
step() { echo "== $1"; shift; "$@" || { echo "!! failed (exit $?): $*"; status=1; }; }

step "environment" bash -c "{ date -u; nvidia-smi; python -c 'import torch, dtensor_ulysses.attention as a; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"flash_attn\", a.flash_attn_available())'; } | tee '$out/gpu_environment.txt'"
step "GPU-only tests" bash -c "python -m pytest -q -m gpu tests 2>&1 | tee '$out/gpu_tests.txt'"
step "MFU sweep" python -m benchmarks.bench_long_context --models llama3-1b --features ac \
    --compile --seq-lens 8192 16384 32768 --steps 5 --json "$out/bench_mfu_gpu.json"
step "longest sequence" python -m benchmarks.bench_long_context --models llama3-1b llama3-8b \
    --features all --seq-lens max --steps 3 --json "$out/bench_long_context_gpu.json"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
    step "all-to-all vs NCCL" torchrun --standalone --nproc-per-node "$gpus" -m benchmarks.bench_a2a \
        --sizes-mib 16 64 256 1024 --json "$out/bench_a2a_gpu.json"
else
    echo "== all-to-all vs NCCL: skipped ($gpus GPU; it needs 2 or more)"
fi
exit $status
