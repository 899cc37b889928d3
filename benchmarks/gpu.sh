#!/usr/bin/env bash
# Every GPU check of this project, on a lent machine (one node, 1-8 GPUs):
#
#     bash benchmarks/gpu.sh [OUT_DIR] [STEP ...]   # OUT_DIR default: benchmarks/results
#
# STEPs (default: all, in this order; on a machine that limits each command to 10 minutes, run
# one or two per command):
#   env    the environment (nvidia-smi, torch, CUDA, flash-attn)  -> OUT_DIR/gpu_environment.txt
#   tests  the GPU-only tests (pytest -m gpu)                      -> OUT_DIR/gpu_tests.txt
#   mfu    the MFU sweep: llama3-1b at 8K-32K tokens, compiled blocks (issue #14: >= 50% at 32K)
#                                                                  -> OUT_DIR/bench_mfu_gpu.json
#   long   real steps at 128K tokens with every memory feature, the allocator's peak next to the
#          trace's                                                 -> OUT_DIR/bench_long_context_gpu.json
#   a2a    with 2+ GPUs: the Ulysses exchange against NCCL's own all-to-all at equal bytes
#          (issue #14: within 10%)                                 -> OUT_DIR/bench_a2a_gpu.json
# Each step prints as it goes; a failing step is reported and the next one still runs; the exit
# status is 1 if any step failed.
set -uo pipefail
out=${1:-benchmarks/results}
shift || true
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests mfu long a2a)
mkdir -p "$out"
status=0
run() { echo "== $1"; shift; "$@" || { echo "!! failed (exit $?): $*"; status=1; }; }

for s in "${steps[@]}"; do
    case "$s" in
    env) run env bash -c "{ date -u; nvidia-smi; python -c 'import torch, dtensor_ulysses.attention.local as a; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"flash_attn\", a.flash_attn_available())'; } | tee '$out/gpu_environment.txt'" ;;
    tests) run tests bash -c "python -m pytest -q -m gpu tests 2>&1 | tee '$out/gpu_tests.txt'" ;;
    mfu) run mfu python -m benchmarks.bench_long_context --models llama3-1b --features ac \
        --compile --seq-lens 8192 16384 32768 --steps 5 --json "$out/bench_mfu_gpu.json" ;;
    long) run long python -m benchmarks.bench_long_context --models llama3-1b llama3-8b \
        --features all --seq-lens 131072 --steps 3 --json "$out/bench_long_context_gpu.json" ;;
    a2a)
        gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
        if [ "$gpus" -ge 2 ]; then
            run a2a torchrun --standalone --nproc-per-node "$gpus" -m benchmarks.bench_a2a \
                --sizes-mib 16 64 256 1024 --json "$out/bench_a2a_gpu.json"
        else
            echo "== a2a: skipped ($gpus GPU; it needs 2 or more)"
        fi ;;
    *) echo "unknown step '$s' (use: env tests mfu long a2a)"; exit 2 ;;
    esac
done
exit $status
