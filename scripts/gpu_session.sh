#!/usr/bin/env bash
# Batched runs on a GPU machine (the `device` tool), in three parts that each fit one device call
# (<= 10 minutes): GPU tests and NCCL launch checks; GPU benchmarks; CPU benchmarks on the host's
# cores (broadcast vs vLLM's MessageQueue, array input). Every step has its own time limit; logs
# and JSON go to $OUT.
#   bash scripts/gpu_session.sh tests|gpu_bench|cpu_bench|issue18|round5_tests|round5_bench|all
#   (OUT defaults to ./out; round5_*: the package/rooms, plain-model, strict-wire and persistent
#   broadcast round: GPU tests of every path they touch, the real model on the GPU, benches)
#   carry mq_bundle (bash ../shared/tools/mq_bundle.sh mq_bundle 3.12) for the mq column
set -u
PART=${1:-all}
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
echo "GPUs: $NGPU"

part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
W="1"; for w in 2 4 8; do [ "$NGPU" -ge "$w" ] && W="$W $w"; done

if part tests; then  # ~8 min
  TAILN=4 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -x -k "cuda or gpu or triton or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
    tests/test_slot_mapping.py tests/test_yoco_cp.py tests/test_mirror_metadata.py tests/test_gpu_broadcast.py \
    tests/test_mirror_multirank.py tests/test_broadcast_multirank.py tests/test_slot_mapping_groups.py
  # in-place decode: capacity masks, CP staged decode (world 1 NCCL; 2-3 gloo ranks sharing cuda:0)
  TAILN=6 step gpu_decode_cp 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cp.py tests/test_decode_capacity.py
  # attention check on CUDA (bf16 SDPA prefill, bf16 KV-cache decode; tolerance 2e-2)
  step attn_nccl1 60 python3 -m launch --backend nccl --nproc-per-node 1 --workload mixed --attention-check --kv-interleave 128 --steps 12 --decode-seqs 16
  # gloo ranks sharing cuda:0: metadata, verify and the bf16 attention check on the GPU at CP 2 and 3
  TAILN=3 step attn_gloo_cuda0_cp2 90 python3 -m launch --backend gloo --device cuda --nproc-per-node 2 --workload mixed --cp-mirror --verify --attention-check --kv-interleave 128 --steps 12 --decode-seqs 16
  TAILN=3 step attn_gloo_cuda0_cp3 90 python3 -m launch --backend gloo --device cuda --nproc-per-node 3 --workload mixed --cp-mirror --verify --attention-check --kv-interleave 1 --steps 12 --decode-seqs 16
  step launch_nccl1 50 python3 -m launch --backend nccl --nproc-per-node 1 --workload mixed --cp-mirror --attn-info --steps 100 --verify --json "$OUT/launch_nccl1.json"
  if [ "$NGPU" -ge 2 ]; then
    for I in 1 128; do
      TAILN=3 step attn_nccl${NGPU}_i$I 150 python3 -m launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --verify --attention-check --kv-interleave $I --steps 12 --decode-seqs 16
    done
    TAILN=8 step launch_nccl$NGPU 120 python3 -m launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --attn-info --kv-interleave 16 --steps 200 --verify --json "$OUT/launch_nccl$NGPU.json"
  fi
fi

if part gpu_bench; then  # ~7 min
  TAILN=12 step bench_inplace 120 python3 scripts/bench_decode_inplace.py --out "$OUT/inplace.json"
  TAILN=8 step bench_cp_nccl1 45 python3 scripts/bench_decode_cp.py --backend nccl --worlds 1 --steps 200 --budget 5 --out "$OUT/decode_cp_nccl1.json"
  TAILN=8 step bench_cp_gloo_cuda0 75 python3 scripts/bench_decode_cp.py --device cuda --worlds 2 3 --steps 200 --budget 5 --out "$OUT/decode_cp_gloo_cuda0.json"
  TAILN=10 step bench_slot_groups 90 python3 scripts/bench_slot_mapping.py --groups --out "$OUT/slot_groups.json"
  TAILN=12 step bench_attn 50 python3 scripts/bench_build.py --device cuda --only attn --no-ref --out "$OUT/build_cuda.json"
  TAILN=20 step bench_bcast_nccl 90 python3 scripts/bench_broadcast.py --backend nccl --worlds $W --attn-info 0 --modes barrier --out "$OUT/bcast_nccl.json"
fi

if part cpu_bench; then  # ~8 min; issue 17 (broadcast vs mq, worlds 2/4/8) and issue 18 (array input) on idle cores
  MQ=""; [ -d mq_bundle ] && MQ=":$PWD/mq_bundle"
  TAILN=40 step bench_bcast_cpu 300 env PYTHONPATH="$PWD$MQ" python3 scripts/bench_broadcast.py --worlds 2 4 8 \
    --payloads decode-64 decode-256 prompt-32k --attn-info 0 --methods cpmeta cpmeta+bs mq floor \
    --steps 100 --budget 2 --out "$OUT/bcast_cpu.json"
  for w in 2 8; do
    TAILN=24 step profile_bcast_w$w 45 python3 scripts/profile_broadcast.py --world $w --mode engine --steps 300 --json "$OUT/profile_w$w.json"
  done
  TAILN=6 step bench_state 60 python3 scripts/bench_build.py --only state_ --no-ref --repeat 300 --out "$OUT/build_state.json"
  TAILN=30 step profile_array 45 python3 scripts/profile_array_input.py --repeat 500 --out "$OUT/array_phases.json"
fi
if part issue18; then  # ~5 min; the array-input fast paths (issue 18): GPU tests of the paths they touch, then benches
  TAILN=4 step gpu_tests18 240 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_graph.py \
    tests/test_decode_inplace.py tests/test_stage_decode.py tests/test_decode_cp.py tests/test_decode_capacity.py \
    tests/test_batch_state.py tests/test_builders_smoke.py
  TAILN=6 step inplace_step 90 python3 scripts/profile_inplace_step.py --repeat 1000 --cp --out "$OUT/inplace_step.json"
  TAILN=8 step bench_inplace 120 python3 scripts/bench_decode_inplace.py --out "$OUT/inplace.json"
  TAILN=8 step bench_cp_nccl1 60 python3 scripts/bench_decode_cp.py --backend nccl --worlds 1 --steps 300 --budget 5 --out "$OUT/decode_cp_nccl1.json"
  TAILN=8 step bench_cp_gloo_cuda0 90 python3 scripts/bench_decode_cp.py --device cuda --worlds 2 3 --steps 200 --budget 5 --out "$OUT/decode_cp_gloo_cuda0.json"
  TAILN=6 step bench_state 60 python3 scripts/bench_build.py --only state_ --no-ref --repeat 300 --out "$OUT/build_state.json"
  # where the time of gloo ranks sharing cuda:0 goes: 1-3 independent processes, each step synced
  TAILN=7 step gpu_sharing 150 python3 scripts/bench_gpu_sharing.py --procs 1 2 3 --seconds 3 --out "$OUT/gpu_sharing.json"
fi
if [ "$PART" = round5_tests ]; then  # ~9 min: GPU paths of the round's changes
  TAILN=6 step gpu_tests5 280 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
    tests/test_slot_mapping.py tests/test_yoco_cp.py tests/test_mirror_metadata.py tests/test_gpu_broadcast.py \
    tests/test_broadcast_multirank.py tests/test_slot_mapping_groups.py tests/test_kv_read_plan.py \
    tests/test_broadcast_persistent.py tests/test_stage_decode.py tests/test_batch_state.py
  TAILN=4 step gpu_decode_cp5 120 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cp.py tests/test_decode_capacity.py
  for M in seed plain; do
    TAILN=3 step attn_nccl1_$M 60 python3 -m launch --backend nccl --nproc-per-node 1 --model $M --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
    TAILN=3 step attn_gloo_cuda0_cp3_$M 90 python3 -m launch --backend gloo --device cuda --nproc-per-node 3 --model $M --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
  done
  # the real model on the GPU: NCCL world 1, gloo ranks sharing cuda:0; float32 / bf16 / float64
  for A in "--cp 1 --dtype float32" "--cp 1 --dtype bfloat16" "--cp 2 --dtype float32 --interleave 16" \
           "--cp 3 --dtype bfloat16" "--cp 2 --dtype float64" "--cp 2 --dtype float32 --config seed"; do
    n=$(echo "$A" | tr -d ' -'); TAILN=3 step gen_$n 60 python3 scripts/cp_generate.py --device cuda $A --json "$OUT/gen_$n.json"
  done
  step launch_nccl1_5 50 python3 -m launch --backend nccl --nproc-per-node 1 --workload mixed --cp-mirror --attn-info --steps 100 --verify
fi
if [ "$PART" = round5_inplace ]; then  # ~4 min: the in-place step's host-call cuts (cached stream, cached step views)
  TAILN=4 step gpu_inplace5 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_decode_inplace.py \
    tests/test_stage_decode.py tests/test_decode_cp.py tests/test_decode_capacity.py
  TAILN=6 step inplace_step5b 90 python3 scripts/profile_inplace_step.py --repeat 1000 --cp --out "$OUT/inplace_step5b.json"
  TAILN=8 step bench_build5b 60 python3 scripts/bench_build.py --only state_ --no-ref --repeat 300 --out "$OUT/build_state5b.json"
fi
if [ "$PART" = round5_bench ]; then  # ~9 min: steady-state broadcast vs mq on the host's cores, the in-place step
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  TAILN=40 step bench_bcast5 330 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_broadcast.py \
    --worlds 2 4 8 --payloads decode-64 decode-256 prompt-32k --attn-info 0 --modes engine \
    --methods cpmeta cpmeta+p mq floor --steps 100 --budget 2 --out "$OUT/bcast5_cpu.json"
  for w in 2 8; do
    TAILN=24 step profile5_w${w}_p 30 python3 scripts/profile_broadcast.py --world $w --mode engine --steps 300 --persistent --json "$OUT/profile5_w${w}_p.json"
  done
  TAILN=14 step bench_bcast5_nccl 60 python3 scripts/bench_broadcast.py --backend nccl --worlds 1 --payloads decode-64 decode-256 \
    --attn-info 0 --modes barrier --methods cpmeta cpmeta+p floor --steps 200 --budget 3 --out "$OUT/bcast5_nccl.json"
  TAILN=6 step inplace_step5 60 python3 scripts/profile_inplace_step.py --repeat 1000 --out "$OUT/inplace_step5.json"
  TAILN=8 step bench_build5 60 python3 scripts/bench_build.py --only state_ --no-ref --repeat 300 --out "$OUT/build_state5.json"
  TAILN=10 step bench_plain5 60 python3 scripts/bench_build.py --only plain_vs_seed --no-ref --repeat 200 --out "$OUT/build_plain5.json"
fi
ls -la "$OUT"
