#!/usr/bin/env bash
# Batched runs on a GPU machine (the `device` tool), in named suites that stay the same from round
# to round; each fits one device call (<= 10 minutes) and every step has its own time limit.
#
#   bash scripts/gpu_session.sh tests        # GPU tests of every device path, NCCL / gloo-on-cuda launch
#                                            # checks, the CP attention check, the real model on the GPU
#   bash scripts/gpu_session.sh bench-gpu    # in-place decode, its step profile, CP staged decode,
#                                            # slot mapping groups, compute_attn_info, NCCL broadcast
#   bash scripts/gpu_session.sh bench-cpu    # the host's cores: broadcast vs vLLM's MessageQueue (gloo),
#                                            # its per-phase profile, array input, plain vs seed builds
#
# Logs and JSON go to $OUT (default ./out). Result files are named after the benchmark files of
# docs/benchmarks/ (h200_<benchmark>[.<variant>].json, each with its run block), so a session is
# folded in with `python scripts/bench_results.py add $OUT --id <run id>` and the docs' tables are
# refreshed with `python scripts/bench_results.py render` (docs/benchmarks.md). For the mq column of
# bench-cpu carry mq_bundle312 (bash ../shared/tools/mq_bundle.sh mq_bundle312 3.12).
set -u
SUITE=${1:?usage: gpu_session.sh tests|bench-gpu|bench-cpu}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n "${TAILN:-6}" "$OUT/$name.log"
}
nvidia-smi -L; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'
echo "suite $SUITE, GPUs: $NGPU"
W="1"; for w in 2 4 8; do [ "$NGPU" -ge "$w" ] && W="$W $w"; done

case "$SUITE" in
tests)  # ~9 min
  TAILN=6 step gpu_tests 280 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
    tests/test_slot_mapping.py tests/test_yoco_cp.py tests/test_mirror_metadata.py tests/test_gpu_broadcast.py \
    tests/test_broadcast_multirank.py tests/test_slot_mapping_groups.py tests/test_kv_read_plan.py \
    tests/test_broadcast_persistent.py tests/test_stage_decode.py tests/test_batch_state.py
  # in-place decode: capacity masks, CP staged decode (world 1 NCCL; 2-3 gloo ranks sharing cuda:0)
  TAILN=4 step gpu_decode_cp 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cp.py tests/test_decode_capacity.py
  for M in seed plain; do  # the bf16 CP attention check: NCCL world 1, gloo ranks sharing cuda:0
    TAILN=3 step attn_nccl1_$M 60 python3 -m launch --backend nccl --nproc-per-node 1 --model $M --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
    TAILN=3 step attn_gloo_cuda0_cp3_$M 90 python3 -m launch --backend gloo --device cuda --nproc-per-node 3 --model $M --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
  done
  # the real model on the GPU: NCCL world 1, gloo ranks sharing cuda:0; float32 / bf16 / float64
  for A in "--cp 1 --dtype float32" "--cp 1 --dtype bfloat16" "--cp 2 --dtype float32 --interleave 16" \
           "--cp 3 --dtype bfloat16" "--cp 2 --dtype float64" "--cp 2 --dtype float32 --config seed"; do
    n=$(echo "$A" | tr -d ' -'); TAILN=3 step gen_$n 60 python3 scripts/cp_generate.py --device cuda $A --json "$OUT/gen_$n.json"
  done
  step launch_nccl1 50 python3 -m launch --backend nccl --nproc-per-node 1 --workload mixed --cp-mirror --attn-info --steps 100 --verify
  if [ "$NGPU" -ge 2 ]; then
    TAILN=3 step attn_nccl${NGPU} 150 python3 -m launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --verify --attention-check --kv-interleave 128 --steps 12 --decode-seqs 16
    TAILN=8 step launch_nccl$NGPU 120 python3 -m launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --attn-info --kv-interleave 16 --steps 200 --verify
  fi
  ;;
bench-gpu)  # ~8 min
  TAILN=12 step bench_inplace 120 python3 scripts/bench_decode_inplace.py --out "$OUT/h200_inplace.json"
  TAILN=6 step inplace_step 90 python3 scripts/profile_inplace_step.py --repeat 1000 --cp --out "$OUT/h200_inplace_step.json"
  TAILN=8 step bench_cp_nccl1 60 python3 scripts/bench_decode_cp.py --backend nccl --worlds 1 --steps 300 --budget 5 --out "$OUT/h200_decode_cp.nccl1.json"
  TAILN=8 step bench_cp_gloo_cuda0 90 python3 scripts/bench_decode_cp.py --device cuda --worlds 2 3 --steps 200 --budget 5 --out "$OUT/h200_decode_cp.gloo-cuda0.json"
  TAILN=7 step gpu_sharing 60 python3 scripts/bench_gpu_sharing.py --procs 1 2 3 --seconds 3 --out "$OUT/h200_gpu_sharing.json"
  TAILN=10 step bench_slot_groups 60 python3 scripts/bench_slot_mapping.py --groups --out "$OUT/h200_slot_mapping.groups.json"
  TAILN=12 step bench_attn 40 python3 scripts/bench_build.py --device cuda --only attn --no-ref --out "$OUT/h200_build.cuda.json"
  TAILN=14 step bench_bcast_nccl 60 python3 scripts/bench_broadcast.py --backend nccl --worlds $W --payloads decode-64 decode-256 \
    --attn-info 0 --modes barrier --methods cpmeta cpmeta+p floor --steps 200 --budget 3 --out "$OUT/h200_broadcast_nccl.json"
  ;;
bench-cpu)  # ~9 min: the host's cores
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  TAILN=40 step bench_bcast 330 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_broadcast.py \
    --worlds 2 4 8 --payloads decode-64 decode-256 prompt-32k --attn-info 0 --modes engine \
    --methods cpmeta cpmeta+p mq floor --steps 100 --budget 2 --out "$OUT/h200_broadcast.json"
  for w in 2 8; do
    TAILN=24 step profile_bcast_w$w 30 python3 scripts/profile_broadcast.py --world $w --mode engine --steps 300 --persistent --json "$OUT/profile_bcast_w$w.json"
  done
  TAILN=8 step bench_state 60 python3 scripts/bench_build.py --only state_ --no-ref --repeat 300 --out "$OUT/h200_build_state.json"
  TAILN=10 step bench_plain 60 python3 scripts/bench_build.py --only plain_vs_seed --no-ref --repeat 200 --out "$OUT/h200_build.plain.json"
  TAILN=30 step profile_array 45 python3 scripts/profile_array_input.py --repeat 500 --out "$OUT/h200_array_phases.json"
  ;;
*)
  echo "unknown suite $SUITE: expected tests, bench-gpu or bench-cpu" >&2; exit 2
  ;;
esac
ls -la "$OUT"
