#!/usr/bin/env bash
# One batched run on a GPU machine (the `device` tool): GPU tests, kernel benchmarks, NCCL launch
# and the broadcast benchmark. Every step has its own time limit; logs and JSON go to $OUT.
#   bash scripts/gpu_session.sh            (OUT defaults to ./out)
set -u
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
TAILN=4 step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -x -k "cuda or gpu or triton or graph or nccl" \
  tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
  tests/test_slot_mapping.py tests/test_yoco.py tests/test_mirror.py tests/test_gpu_broadcast.py \
  tests/test_mirror_multirank.py tests/test_broadcast_multirank.py
step launch_nccl1 60 python3 -m launch --backend nccl --nproc-per-node 1 --workload mixed --cp-mirror --attn-info --steps 100 --verify --json "$OUT/launch_nccl1.json"
if [ "$NGPU" -ge 2 ]; then
  TAILN=8 step launch_nccl$NGPU 120 python3 -m launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --attn-info --kv-interleave 16 --steps 200 --verify --json "$OUT/launch_nccl$NGPU.json"
  TAILN=8 step launch_nccl${NGPU}_decode 60 python3 -m launch --backend nccl --nproc-per-node "$NGPU" --workload decode --steps 200 --json "$OUT/launch_nccl${NGPU}_decode.json"
fi
TAILN=12 step bench_inplace 90 python3 scripts/bench_decode_inplace.py --out "$OUT/inplace.json"
TAILN=12 step bench_attn 60 python3 scripts/bench_build.py --device cuda --only attn --no-ref --out "$OUT/build_cuda.json"
W="1"; for w in 2 4 8; do [ "$NGPU" -ge "$w" ] && W="$W $w"; done
TAILN=20 step bench_bcast_nccl 150 python3 scripts/bench_broadcast.py --backend nccl --worlds $W --attn-info 0 --modes barrier --out "$OUT/bcast_nccl.json"
# CPU/gloo broadcast on this host's cores (issue 17 goals), mq from the carried bundle when present:
#   bash /work/shared/tools/mq_bundle.sh mq_bundle 3.12   (on the dev machine; carry mq_bundle)
MQ=""; [ -d mq_bundle ] && MQ=":$PWD/mq_bundle"
TAILN=40 step bench_bcast_cpu 420 env PYTHONPATH="$PWD$MQ" python3 scripts/bench_broadcast.py --worlds 2 4 8 \
  --payloads decode-64 decode-256 prompt-32k --attn-info 0 --methods cpmeta cpmeta+bs mq floor \
  --steps 100 --budget 2 --out "$OUT/bcast_cpu.json"
for w in 2 4 8; do
  TAILN=24 step profile_bcast_w$w 60 python3 scripts/profile_broadcast.py --world $w --mode engine --steps 300 --json "$OUT/profile_w$w.json"
done
ls -la "$OUT"
