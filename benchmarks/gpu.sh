#!/usr/bin/env bash
# Every GPU check of this project, on a lent machine (one node, 1-8 GPUs):
#
#     bash benchmarks/gpu.sh [OUT_DIR] [STEP ...]   # OUT_DIR default: benchmarks/results
#     DRY_RUN=1 bash benchmarks/gpu.sh OUT_DIR      # the whole script on the CPU, tiny shapes (CI)
#
# STEPs (default: all, in this order; each is sized for a lent machine's 10-minute command, one
# GPU and 128 GiB of host memory: run one per command):
#   env    the environment (nvidia-smi, torch, CUDA, flash-attn)  -> OUT_DIR/gpu_environment.txt
#   tests  the GPU-only tests (pytest -m gpu)                      -> OUT_DIR/gpu_tests.txt
#   mfu    the MFU sweep: llama3-1b at 8K-32K tokens, compiled blocks (issue #14: >= 50% at 32K)
#                                                                  -> OUT_DIR/bench_mfu_gpu.json
#   long   llama3-1b at 128K tokens with every memory feature, the allocator's peak next to the
#          trace's                                                 -> OUT_DIR/bench_long_context_gpu.json
#   long4b qwen3-4b at 64K tokens with every memory feature (--offload-params: AdamW's 16 bytes
#          a parameter on the host, 60 GiB; the checkpoints 11 GiB), the trace beside it. Not
#          llama3-8b: its 16 bytes a parameter are 119.7 GiB wherever they live, past the 90% of
#          a 128 GiB machine's host that the trainer's preflight allows (it would be refused)
#                                                                  -> OUT_DIR/bench_long_context_4b_gpu.json
#   a2a    with 2+ GPUs: the Ulysses exchange against NCCL's own all-to-all at equal bytes
#          (issue #14: within 10%)                                 -> OUT_DIR/bench_a2a_gpu.json
#   hf     with 2+ GPUs and trl installed: with_ulysses in TRL's SFTTrainer (packed, tiled loss,
#          sp = the GPUs) and in transformers' Trainer (sp 2, evaluation), GRPO (sp = the GPUs,
#          a reference model), the examples/ scripts
#                                                                  -> OUT_DIR/gpu_hf.txt
# Each step prints as it goes; a failing step (any command of it, also inside a pipe) is reported
# and the next one still runs; the exit status is 1 if any step failed.
# Environment: PYTHON (default python3); DRY_RUN=1 runs every step on the CPU with the tiny model
# and tiny lengths (no nvidia-smi; the a2a step on 2 gloo processes), to check the script itself,
# and first checks the real shapes of mfu, long and long4b against the trainer's memory preflight
# on one H100 with HOST_GIB (default 120: a 128 GiB machine less what the system holds) of host
# memory: a real step that the trainer would refuse fails the dry run.
set -uo pipefail
out=${1:-benchmarks/results}
shift || true
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests mfu long long4b a2a hf)
py=${PYTHON:-python3}
dry=${DRY_RUN:-0}
mkdir -p "$out"
status=0
run() { echo "== $1"; shift; "$@" || { echo "!! failed (exit $?): $*"; status=1; }; }

# the real shapes (what a GPU runs)
mfu_real=(--models llama3-1b --features ac --seq-lens 8192 16384 32768)
long_real=(--models llama3-1b --features all --seq-lens 131072)
long4b_real=(--models qwen3-4b --features all --seq-lens 65536)
if [ "$dry" = 1 ]; then  # the same steps, on the CPU, with shapes that take seconds
    dev=(--device cpu)
    mfu_args=(--models tiny --features ac --compile aot_eager --seq-lens 64 128 --steps 2)
    long_args=(--models tiny --features all --seq-lens 128 --steps 2)
    long4b_args=(--models tiny --features all --seq-lens 128 --steps 2)
    tests_args=(tests/attention/test_local_kernel.py)
else
    dev=()
    mfu_args=("${mfu_real[@]}" --compile --steps 5)
    long_args=("${long_real[@]}" --steps 3)
    long4b_args=("${long4b_real[@]}" --steps 3)
    tests_args=(tests)
fi
preflight() {  # DRY_RUN: would the trainer start the real shapes of step $1 on the GPU machine?
    local step=$1
    shift
    [ "$dry" = 1 ] && run "$step preflight" "$py" -m benchmarks.bench_long_context "$@" \
        --preflight-only --gpu h100 --host-memory "${HOST_GIB:-120}"
}

env_step() {
    date -u
    if [ "$dry" = 1 ]; then echo "DRY_RUN: no nvidia-smi"; else nvidia-smi; fi
    "$py" -c 'import torch, dtensor_ulysses.attention as a; print("torch", torch.__version__, "cuda", torch.version.cuda, "flash_attn", a.flash_attn_available())'
}

for s in "${steps[@]}"; do
    case "$s" in
    env) run env eval 'env_step 2>&1 | tee "$out/gpu_environment.txt"' ;;
    tests) run tests eval '"$py" -m pytest -q -m gpu "${tests_args[@]}" 2>&1 | tee "$out/gpu_tests.txt"' ;;
    mfu) preflight mfu "${mfu_real[@]}"
        run mfu "$py" -m benchmarks.bench_long_context "${mfu_args[@]}" "${dev[@]}" \
        --json "$out/bench_mfu_gpu.json" ;;
    long) preflight long "${long_real[@]}"
        run long "$py" -m benchmarks.bench_long_context "${long_args[@]}" "${dev[@]}" \
        --json "$out/bench_long_context_gpu.json" ;;
    long4b) preflight long4b "${long4b_real[@]}"
        run long4b "$py" -m benchmarks.bench_long_context "${long4b_args[@]}" "${dev[@]}" \
        --json "$out/bench_long_context_4b_gpu.json" ;;
    a2a)
        if [ "$dry" = 1 ]; then
            run a2a "$py" -m benchmarks.bench_a2a --cpu-world 2 --sizes-mib 1 \
                --json "$out/bench_a2a_gpu.json"
        else
            gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
            if [ "$gpus" -ge 2 ]; then
                run a2a torchrun --standalone --nproc-per-node "$gpus" -m benchmarks.bench_a2a \
                    --sizes-mib 16 64 256 1024 --json "$out/bench_a2a_gpu.json"
            else
                echo "== a2a: skipped ($gpus GPU; it needs 2 or more)"
            fi
        fi ;;
    hf)
        if [ "$dry" = 1 ]; then n=2; else n=$(nvidia-smi -L 2>/dev/null | wc -l); fi
        if [ "$n" -lt 2 ]; then
            echo "== hf: skipped ($n GPU; with_ulysses needs 2 or more processes)"
        elif ! "$py" -c 'import trl' 2>/dev/null; then
            echo "== hf: skipped (no trl: pip install -e \".[hf]\")"
        else
            launch=("$py" -m torch.distributed.run --standalone --nproc-per-node "$n")
            run hf eval '{ "${launch[@]}" examples/sft_trl.py --sp "$n" --packing --tiled-loss \
                --out "$out/hf_sft" && "${launch[@]}" examples/trainer_hf.py --sp 2 --eval \
                --out "$out/hf_trainer" && "${launch[@]}" examples/grpo_trl.py --sp "$n" \
                --beta 0.04 --steps 2 --out "$out/hf_grpo"; } 2>&1 | tee "$out/gpu_hf.txt"'
        fi ;;
    *) echo "unknown step '$s' (use: env tests mfu long long4b a2a hf)"; exit 2 ;;
    esac
done
[ "$status" = 0 ] && echo "== all steps passed" || echo "!! some step failed (see above)"
exit $status
