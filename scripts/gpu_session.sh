#!/usr/bin/env bash
# Batched runs on a GPU machine (the `device` tool), in named suites that stay the same from round
# to round; each fits one device call (<= 10 minutes) and every step has its own time limit.
#
#   bash scripts/gpu_session.sh tests        # GPU tests of every device path, NCCL / gloo-on-cuda launch
#                                            # checks (both strategies), the CP attention check, the real model
#   bash scripts/gpu_session.sh bench-gpu    # the end-to-end step on the device, CP staged / replicated
#                                            # in-place decode, overlap, in-place decode, NCCL broadcast
#   bash scripts/gpu_session.sh bench-cpu    # the host's cores: the end-to-end step (worlds 2/4/8, four
#                                            # strategies), broadcast vs vLLM's MessageQueue and tensor dict
#   bash scripts/gpu_session.sh wire         # the host's cores at world 8: ring slot size, follower spin,
#                                            # an experiment tree in .alt against this one
#   bash scripts/gpu_session.sh replay       # the host's cores: this tree against .alt at worlds 2 and 8
#                                            # (every host strategy, plain and seed), the idle-gap probe
#   bash scripts/gpu_session.sh warm         # the host's cores at world 8: followers' warming on / off
#   bash scripts/gpu_session.sh rwarm        # the same for the replicated state's followers (replicate-defer)
#   bash scripts/gpu_session.sh arena        # GPU tests of the arenas / broadcast, then this tree against .alt
#                                            # (broadcast, replicate-defer, mq-replicate; worlds 2 and 8)
#   bash scripts/gpu_session.sh warmbuild    # GPU tests, then this tree against .alt2 (an experiment) and .alt
#   bash scripts/gpu_session.sh width        # GPU tests of every decode path (block_tables' width), the CP
#                                            # attention check, the broadcast's phases at world 8
#   bash scripts/gpu_session.sh widthab      # the host's cores: this tree against .alt, plain worlds 2 and 8
#                                            # (alt, this, this, alt), then seed world 8 (this, alt)
#   bash scripts/gpu_session.sh spin         # the host's cores at world 8: followers' spin as chosen / off /
#                                            # without warming, a driver busy between steps, threads per core
#   bash scripts/gpu_session.sh collective   # nvidia-h200-x2: the collective tensor path over NCCL (tests,
#                                            # the launcher, this tree against .alt), the staging writer
#   bash scripts/gpu_session.sh pin          # the host's cores at world 8: each rank unbound / bound to a core
#                                            # of its own / bound with a busy driver (bench_step --pin)
#   bash scripts/gpu_session.sh park         # the host's cores at world 8: the driver asleep / spinning through
#                                            # its gap (decode-64 / decode-256), a decode-256 timeline
#   bash scripts/gpu_session.sh ab           # the host's cores at world 8: this tree against .alt (alt, this,
#                                            # this, alt), MODEL=seed|plain, WORKLOADS (default decode-64 decode-256)
#   bash scripts/gpu_session.sh prefill      # the host's cores: steps with prompts (mixed, prompt), plain and
#                                            # seed, worlds 2 and 8
#   bash scripts/gpu_session.sh knobs        # world 8 decode-64 timeline: this / .alt / .alt2 / followers parking / not warming
#   bash scripts/gpu_session.sh timeline     # the host's cores at world 8: replicate-defer's step as a
#                                            # timeline (decode-64 / mixed / prompt, seed decode-64, .alt prompt)
#   bash scripts/gpu_session.sh wake         # world 8 decode-64 timeline: this / .alt, followers parked or spinning
#   bash scripts/gpu_session.sh check        # world 8: the periodic replica check, this tree against .alt
#   bash scripts/gpu_session.sh compile      # the host's cores: the kernels compiled into an empty numba cache
#                                            # by 1, 2 and warm_all's default count of processes, then loaded
#   bash scripts/gpu_session.sh core         # the host's core: a follower's replay + build hot in one process, alone
#                                            # and beside busy cores; a world-8 follower's split read
#   bash scripts/gpu_session.sh compare      # the host's cores, before / after in one run: the commit in
#                                            # .baseline (git archive REV | tar -x -C .baseline; carry it)
#                                            # and this tree, end-to-end step (plain and compressed-KV
#                                            # models, worlds 2 and 8) and the host builds
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
tests)  # ~9 min: GPU tests of every device path, NCCL / gloo-on-cuda launch checks, the real model
  # the memory cgroup's room this host reports (a ring larger than it is refused) and its tests
  TAILN=3 step cgroup_room 60 bash -c 'python3 -c "from cpmeta.transport._segment import memory_cgroup_room as m; print(\"room:\", m())" && python3 -m pytest -q -p no:cacheprovider -rs tests/test_shm_ring.py -k cgroup'
  TAILN=6 step gpu_tests 250 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
    tests/test_slot_mapping.py tests/test_yoco_cp.py tests/test_mirror_metadata.py tests/test_gpu_broadcast.py \
    tests/test_broadcast_multirank.py tests/test_slot_mapping_groups.py tests/test_kv_read_plan.py \
    tests/test_broadcast_persistent.py tests/test_stage_decode.py tests/test_batch_state.py \
    tests/test_channels.py tests/test_tensor_dict.py
  # in-place decode across ranks: the staged broadcast and the replicated in-place path; overlap
  TAILN=4 step gpu_decode_cp 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cp.py \
    tests/test_decode_capacity.py tests/test_replicate_inplace.py tests/test_overlap.py
  TAILN=3 step attn_nccl1_seed 60 python3 -m cpmeta.launch --backend nccl --nproc-per-node 1 --model seed --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
  for S in broadcast replicate; do  # the bf16 CP attention check, gloo ranks sharing cuda:0
    TAILN=3 step attn_gloo_cuda0_cp3_$S 90 python3 -m cpmeta.launch --backend gloo --device cuda --nproc-per-node 3 --model plain --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16 --strategy $S
  done
  for A in "--cp 1 --dtype float32" "--cp 2 --dtype float32 --interleave 16" "--cp 2 --dtype float32 --strategy replicate"; do
    n=$(echo "$A" | tr -d ' -'); TAILN=3 step gen_$n 60 python3 scripts/cp_generate.py --device cuda $A --json "$OUT/gen_$n.json"
  done
  step launch_nccl1_replicate 50 python3 -m cpmeta.launch --backend nccl --nproc-per-node 1 --workload mixed --cp-mirror --attn-info --steps 100 --verify --strategy replicate
  if [ "$NGPU" -ge 2 ]; then
    TAILN=3 step attn_nccl${NGPU} 150 python3 -m cpmeta.launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --verify --attention-check --kv-interleave 128 --steps 12 --decode-seqs 16
    TAILN=8 step launch_nccl$NGPU 120 python3 -m cpmeta.launch --backend nccl --nproc-per-node "$NGPU" --workload mixed --cp-mirror --attn-info --kv-interleave 16 --steps 200 --verify
  fi
  ;;
compile)  # ~6 min: cpmeta.jit.warm_all() on a cold cache (an empty NUMBA_CACHE_DIR each), then a load of it
  for J in 1 2 default; do
    D=$(mktemp -d); A=$([ $J = default ] || echo "jobs=$J")
    TAILN=1 step compile_$J 200 env NUMBA_CACHE_DIR="$D" python3 -c "import time, cpmeta.jit as j, cpmeta.envs as e; t = time.perf_counter(); j.warm_all($A); print(f'jobs=$J (default {e.warm_jobs()}): compiled in {time.perf_counter() - t:.1f} s')"
    TAILN=1 step load_$J 60 env NUMBA_CACHE_DIR="$D" python3 -c "import time, cpmeta.jit as j; t = time.perf_counter(); j.warm_all(); print(f'loaded in {time.perf_counter() - t:.1f} s')"
    rm -rf "$D"
  done
  # the host's ranks at once (torchrun's LOCAL_WORLD_SIZE=8), one cold cache each run; ALT=<tree>
  # (carried) first, e.g. a tree whose ranks each compiled everything (539fa15)
  for T in ${ALT:-} "$PWD"; do
    TAILN=1 step "compile_ranks_$(basename "$T")" 400 python3 -c '
import os, subprocess, sys, tempfile, time
with tempfile.TemporaryDirectory() as d:
    env = {**os.environ, "NUMBA_CACHE_DIR": d, "LOCAL_WORLD_SIZE": "8", "PYTHONPATH": sys.argv[1]}
    code = "import time; t = time.perf_counter(); import cpmeta.jit as j; j.warm_all(); print(f\"{time.perf_counter() - t:.1f}\")"
    t = time.perf_counter()
    ps = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(8)]
    each = [p.communicate()[0].strip() for p in ps]
    assert all(p.returncode == 0 for p in ps), each
    print(f"{sys.argv[1]}: 8 ranks warmed one cold cache, each {each} s, the last done {time.perf_counter() - t:.1f} s after the start")
' "$T"
  done
  ;;
bench-gpu)  # ~9 min: device-resident figures
  TAILN=20 step bench_step_cuda0 150 python3 scripts/bench_step.py --device cuda --worlds 2 3 --strategies broadcast replicate \
    --steps 80 --budget 6 --out "$OUT/h200_step.gloo-cuda0.json"
  TAILN=12 step bench_step_nccl1 60 python3 scripts/bench_step.py --backend nccl --worlds 1 --strategies broadcast replicate \
    --steps 80 --budget 6 --out "$OUT/h200_step.nccl1.json"
  TAILN=8 step bench_cp_nccl1 60 python3 scripts/bench_gpu.py cp --backend nccl --worlds 1 --steps 300 --budget 5 --out "$OUT/h200_decode_cp.nccl1.json"
  TAILN=8 step bench_cp_gloo_cuda0 90 python3 scripts/bench_gpu.py cp --device cuda --worlds 2 3 --steps 200 --budget 5 --out "$OUT/h200_decode_cp.gloo-cuda0.json"
  TAILN=10 step bench_overlap 60 python3 scripts/bench_gpu.py overlap --device cuda --streams 2 --forward-us 300 --out "$OUT/h200_overlap.json"
  TAILN=12 step bench_inplace 80 python3 scripts/bench_gpu.py inplace --out "$OUT/h200_inplace.json"
  TAILN=14 step bench_bcast_nccl 60 python3 scripts/bench_broadcast.py --backend nccl --worlds $W --payloads decode-64 decode-256 \
    --attn-info 0 --modes barrier --methods cpmeta cpmeta+p cpmeta-tdict tdict floor --steps 200 --budget 3 --out "$OUT/h200_broadcast_nccl.json"
  ;;
bench-cpu)  # ~9 min: the host's cores; mq columns with the carried mq_bundle312
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  TAILN=60 step bench_step 330 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_step.py \
    --worlds 2 4 8 --steps 100 --budget 8 --out "$OUT/h200_step.json"
  TAILN=30 step bench_bcast 200 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_broadcast.py \
    --worlds 2 4 8 --payloads decode-64 decode-256 prompt-32k --attn-info 0 --modes engine \
    --methods cpmeta cpmeta+p cpmeta-tdict tdict mq floor --steps 80 --budget 2 --out "$OUT/h200_broadcast.json"
  ;;
compare)  # ~9 min: before (.baseline) / after (this tree), same host, same commands, one run
  [ -d .baseline/scripts ] || { echo "compare: carry .baseline (git archive REV | tar -x -C .baseline)" >&2; exit 2; }
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import time, cpmeta.jit as j; t = time.perf_counter(); w = j.warm_all(); print(f"kernels compiled in {time.perf_counter() - t:.1f} s ({len(w)} warmers)")'
  python3 -c 'import time, cpmeta.jit as j; t = time.perf_counter(); w = j.warm_all(); print(f"kernels loaded from the cache in {time.perf_counter() - t:.1f} s")'
  for M in plain seed; do
    for V in before after; do
      if [ $V = before ]; then ROOT=$PWD/.baseline; else ROOT=$PWD; fi
      TAILN=40 step step_${M}_$V 150 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
        --model $M --worlds 2 8 --workloads decode-64 decode-256 --strategies broadcast replicate replicate-defer mq-replicate \
        --steps 60 --warmup 8 --budget 4 --no-cold --out "$OUT/h200_step.$M.$V.json"
    done
  done
  for V in before after; do
    if [ $V = before ]; then ROOT=$PWD/.baseline; else ROOT=$PWD; fi
    TAILN=30 step build_$V 100 env PYTHONPATH="$ROOT" python3 "$ROOT/scripts/bench_build.py" --no-ref --repeat 200 \
      --only plain_vs_seed --out "$OUT/h200_build.$V.json"
  done
  TAILN=20 step build_hot 60 python3 scripts/bench_build.py --no-ref --repeat 300 --only hot_ --out "$OUT/h200_build.hot.json"
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files (the plots pushed results out once)
  ;;
wire)  # ~7 min: the host's cores at world 8, the transport's knobs one at a time (ring slot size, the
  # followers' spin) and an experiment tree carried in .alt (git archive REV | tar -x -C .alt) against
  # this one; every run with its own result file (h200_wire.<variant>.<bench>.json)
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  [ -d .alt/scripts ] && (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  for V in default slot1m spin0 alt; do
    ROOT=$PWD; ENVS=""
    case $V in slot1m) ENVS="CPMETA_SHM_SLOT_SIZE=1048576";; spin0) ENVS="CPMETA_SHM_SPIN_US=0";;
      alt) [ -d .alt/scripts ] || continue; ROOT=$PWD/.alt;; esac
    TAILN=16 step wire_step_$V 100 env $ENVS PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --worlds 2 8 --workloads decode-64 decode-256 --strategies broadcast replicate mq-replicate --steps 50 --warmup 6 \
      --budget 3 --no-cold --out "$OUT/h200_wire.$V.step.json"
    [ $V = spin0 ] && continue
    TAILN=12 step wire_bcast_$V 70 env $ENVS PYTHONPATH="$ROOT" python3 "$ROOT/scripts/bench_broadcast.py" --worlds 2 8 \
      --payloads decode-64 decode-256 --attn-info 0 --modes engine --methods cpmeta cpmeta+p floor --steps 60 --budget 2 \
      --out "$OUT/h200_wire.$V.broadcast.json"
  done
  TAILN=30 step wire_phases 60 python3 scripts/profile_phases.py broadcast --world 8 --payload decode-64 --persistent \
    --steps 150
  rm -f "$OUT"/*.png  # at most 8 files come back: the 7 JSON files and one log
  ;;
pin)  # ~6 min: does a rank bound to a core of its own meet warmer caches? world 8 decode-64 with
  # each rank's main thread unbound (default) / on a core of its own (bench_step --pin core) / the
  # same with the driver spinning through its gap (busypin), two rounds in turn; seed once each
  lscpu | grep -iE 'model name|thread|core|socket|numa node|L2|L3'
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in plain:default:1 plain:pin:1 plain:busypin:1 seed:default:1 plain:busypin:2 plain:pin:2 plain:default:2 \
      seed:pin:1; do
    IFS=: read -r M K N <<<"$V"
    PIN=none; PARK=sleep
    case $K in pin) PIN=core;; busypin) PIN=core; PARK=busy;; esac
    TAILN=4 step pin_${M}_${K}_$N 70 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_step.py \
      --pin $PIN --park $PARK --model $M --worlds 8 --workloads decode-64 --strategies broadcast replicate-defer \
      mq-replicate --steps 60 --warmup 6 --budget 4 --no-cold --out "$OUT/h200_wire.pin-$M-$K-$N.json"
  done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
park)  # ~5 min: is the driver's side of a step slow because its core slept through the gap? world 8,
  # plain decode-64 / decode-256, replicate-defer and mq-replicate, the driver asleep (--park sleep,
  # the default) or spinning (--park busy) through its 3 ms, in turn; then replicate-defer's decode-256
  # step as a timeline (profile_phases.py sync: the driver's stages, the last follower's)
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in sleep:1 busy:1 busy:2 sleep:2; do
    IFS=: read -r K N <<<"$V"
    TAILN=6 step park_${K}_$N 80 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_step.py \
      --park $K --model plain --worlds 8 --workloads decode-64 decode-256 --strategies replicate-defer mq-replicate \
      --steps 60 --warmup 6 --budget 4 --no-cold --out "$OUT/h200_wire.park-$K-$N.json"
  done
  TAILN=3 step timeline_d256 60 python3 scripts/profile_phases.py sync --world 8 --defer --model plain \
    --workload decode-256 --steps 60 --out "$OUT/h200_wire.timeline-plain-decode-256.json"
  rm -f "$OUT"/*.png
  ;;
ab)  # ~3 min: this tree against the tree in .alt (git archive REV | tar -x -C .alt), ordered alt,
  # this, this, alt; world 8, $WORKLOADS (default decode-64 decode-256; "mixed prompt" for steps that
  # add and finish requests), model $MODEL (default seed), three strategies
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  for V in alt:1 this:1 this:2 alt:2; do
    IFS=: read -r T N <<<"$V"
    ROOT=$PWD; [ $T = alt ] && ROOT=$PWD/.alt
    TAILN=8 step ab_${T}_$N 70 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --model "${MODEL:-seed}" --worlds 8 --workloads ${WORKLOADS:-decode-64 decode-256} --strategies broadcast replicate-defer \
      mq-replicate --steps 50 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_wire.ab-${MODEL:-seed}-$T-$N.json"
  done
  rm -f "$OUT"/*.png
  ;;
prefill)  # ~3 min: the steps with prompts (mixed: 64 decoding + 8 chunks of 1024; prompt: 8 x 4096),
  # plain and seed, worlds 2 and 8, the host strategies
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for M in plain seed; do
    TAILN=12 step prefill_$M 150 env PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_step.py \
      --model $M --worlds 2 8 --workloads mixed prompt --strategies broadcast replicate-defer mq-replicate \
      --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_step.prefill-$M.json"
  done
  rm -f "$OUT"/*.png
  ;;
replay)  # ~6 min: this tree against the tree in .alt (git archive REV | tar -x -C .alt), plain and
  # seed models, worlds 2 and 8, every host strategy; then what an idle gap costs a call on this host
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  [ -d .alt/scripts ] && (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  TAILN=16 step cold 120 python3 scripts/profile_phases.py cold --out "$OUT/h200_wire.cold.json"
  for M in plain seed; do for V in alt default; do
    ROOT=$PWD; if [ $V = alt ]; then [ -d .alt/scripts ] || continue; ROOT=$PWD/.alt; fi
    TAILN=16 step replay_${M}_$V 110 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --model $M --worlds 2 8 --workloads decode-64 decode-256 --strategies broadcast replicate replicate-defer \
      mq-replicate --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_wire.replay-$M-$V.json"
  done; done
  rm -f "$OUT"/*.png  # at most 8 files come back: 5 JSON files and one log archive
  ;;
warm)  # ~2 min: the followers' warming (CPMETA_WARM) on / off, alternating, world 8 decode-64
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for R in 1 2; do for V in 1 0; do
    TAILN=3 step warm${V}_$R 40 env CPMETA_WARM=$V PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_step.py \
      --worlds 8 --workloads decode-64 --strategies broadcast mq-replicate --steps 40 --warmup 6 --budget 3 --no-cold \
      --out "$OUT/h200_wire.warm$V-$R.json"
  done; done
  ;;
rwarm)  # ~6 min: the replicated followers' warming (CPMETA_WARM) on / off, world 8 decode-64, plain and seed
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for M in plain:1 plain:2 seed:1; do for V in 1 0; do
    TAILN=4 step rwarm_${M%:*}${V}_${M#*:} 90 env CPMETA_WARM=$V PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 \
      scripts/bench_step.py --model ${M%:*} --worlds 8 --workloads decode-64 --strategies broadcast replicate-defer \
      mq-replicate --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_wire.rwarm-${M%:*}$V-${M#*:}.json"
  done; done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
arena)  # ~9 min: the CUDA paths of the builders' arenas and the broadcast (GPU tests), then this tree
  # against .alt (git archive REV | tar -x -C .alt) at worlds 2 and 8, runs ordered alt, this, this, alt
  TAILN=6 step gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_gpu_broadcast.py tests/test_broadcast_multirank.py \
    tests/test_broadcast_persistent.py tests/test_cuda_graph.py tests/test_decode_inplace.py tests/test_persistent_budget.py
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  [ -d .alt/scripts ] && (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  for V in alt:1 default:1 default:2 alt:2; do
    ROOT=$PWD; if [ ${V%:*} = alt ]; then [ -d .alt/scripts ] || continue; ROOT=$PWD/.alt; fi
    TAILN=12 step arena_${V%:*}_${V#*:} 100 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --model plain --worlds 2 8 --workloads decode-64 decode-256 --strategies broadcast replicate-defer mq-replicate \
      --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_wire.arena-${V%:*}-${V#*:}.json"
  done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
warmbuild)  # ~9 min: GPU tests of the arenas / builders / in-place paths, then this tree against .alt2
  # (an experiment: this tree minus one change) and .alt (the tree before), plain worlds 2 and 8
  TAILN=6 step gpu_tests 180 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_gpu_broadcast.py tests/test_broadcast_persistent.py \
    tests/test_cuda_graph.py tests/test_decode_inplace.py tests/test_stage_decode.py tests/test_replicate_inplace.py \
    tests/test_prompt_share.py
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  for R in . .alt .alt2; do [ -d $R/scripts ] && (cd $R && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()'); done
  for V in default:1 alt2:1 alt:1 alt:2 alt2:2 default:2; do
    case ${V%:*} in default) ROOT=$PWD;; alt) ROOT=$PWD/.alt;; alt2) ROOT=$PWD/.alt2;; esac
    [ -d "$ROOT/scripts" ] || continue
    TAILN=4 step wb_${V%:*}_${V#*:} 80 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --model plain --worlds 2 8 --workloads decode-64 decode-256 --strategies broadcast replicate-defer mq-replicate \
      --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_wire.warmbuild-${V%:*}-${V#*:}.json"
  done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
width)  # ~8 min: every decode path on the GPU after block_tables became as wide as the batch, the
  # CP attention check on NCCL (decode reads KV through the narrowed tables), the broadcast's phases
  TAILN=6 step gpu_tests 260 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
    tests/test_gpu_broadcast.py tests/test_broadcast_persistent.py tests/test_stage_decode.py \
    tests/test_kv_read_plan.py tests/test_persistent_budget.py tests/test_batch_state.py
  TAILN=4 step gpu_decode_cp 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cp.py \
    tests/test_decode_capacity.py tests/test_replicate_inplace.py
  TAILN=3 step attn_nccl1_seed 60 python3 -m cpmeta.launch --backend nccl --nproc-per-node 1 --model seed --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
  TAILN=3 step attn_gloo_cuda0_cp3_plain 90 python3 -m cpmeta.launch --backend gloo --device cuda --nproc-per-node 3 --model plain --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16 --strategy broadcast
  TAILN=30 step profile_w8 80 python3 scripts/profile_phases.py broadcast --world 8 --payload decode-64 --persistent --begin-step --steps 200
  ;;
widthab)  # ~9 min: this tree against .alt (git archive REV | tar -x -C .alt), plain worlds 2 and 8, runs
  # ordered alt, this, this, alt, then the seed config at world 8 (this, alt)
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  for R in . .alt; do [ -d $R/scripts ] && (cd $R && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()'); done
  for V in plain:alt:1 plain:default:1 plain:default:2 plain:alt:2 seed:default:1 seed:alt:1; do
    IFS=: read -r M T N <<<"$V"; ROOT=$PWD; [ $T = alt ] && ROOT=$PWD/.alt; [ -d "$ROOT/scripts" ] || continue
    WS="2 8"; [ $M = seed ] && WS="8"
    TAILN=4 step wab_${M}_${T}_$N 90 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --model $M --worlds $WS --workloads decode-64 decode-256 --strategies broadcast replicate-defer mq-replicate \
      --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_wire.width-$M-$T-$N.json"
  done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
spin)  # ~8 min: do spinning followers slow a world-8 step? The host's topology (threads per core),
  # then plain world 8 decode-64 with the followers' spin as chosen (default), off (park at once),
  # without their warm hook, and with the driver spinning through its gap instead of sleeping
  # (bench_step --park busy: how much of a step is the idle core's cold caches), two rounds in turn;
  # mq-replicate shares the cores with cpmeta's followers
  lscpu | grep -iE 'model name|thread|core|socket|numa node'
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in default:1 spin0:1 nowarm:1 busy:1 default:2 spin0:2 nowarm:2 busy:2; do
    IFS=: read -r K N <<<"$V"
    E=""; PARK=sleep
    case $K in spin0) E="CPMETA_SHM_SPIN_US=0";; nowarm) E="CPMETA_WARM=0";; busy) PARK=busy;; esac
    TAILN=4 step spin_${K}_$N 70 env $E PYTHONPATH="$PWD$MQ" VLLM_TARGET_DEVICE=cpu python3 scripts/bench_step.py \
      --park $PARK --model plain --worlds 8 --workloads decode-64 --strategies broadcast replicate-defer mq-replicate \
      --steps 60 --warmup 6 --budget 4 --no-cold --out "$OUT/h200_wire.spin-$K-$N.json"
  done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
collective)  # ~7 min, made for nvidia-h200-x2 (NCCL between two GPUs; on one GPU the NCCL tests run
  # at world 1): the collective tensor path (the frame's tensor region as one NCCL broadcast, straight
  # into a persistent arena), the transport's channels, the compiled staging writer's device paths,
  # then the NCCL broadcast this tree against .alt (git archive REV | tar -x -C .alt)
  TAILN=6 step gpu_tests 260 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or graph or nccl" \
    tests/test_channels.py tests/test_gpu_broadcast.py tests/test_broadcast_persistent.py tests/test_broadcast_multirank.py \
    tests/test_tensor_dict.py tests/test_stage_decode.py tests/test_decode_inplace.py tests/test_cuda_graph.py
  TAILN=4 step gpu_decode_cp 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_cp.py \
    tests/test_decode_capacity.py tests/test_replicate_inplace.py
  [ "$NGPU" -ge 2 ] && TAILN=8 step launch_nccl2 120 python3 -m cpmeta.launch --backend nccl --nproc-per-node 2 \
    --workload mixed --cp-mirror --attn-info --kv-interleave 16 --steps 200 --verify
  for T in default alt; do
    ROOT=$PWD; [ $T = alt ] && ROOT=$PWD/.alt; [ -d "$ROOT/scripts" ] || continue
    TAILN=10 step bcast_nccl_$T 100 env PYTHONPATH="$ROOT" python3 "$ROOT/scripts/bench_broadcast.py" --backend nccl \
      --worlds $W --payloads decode-256 prompt-8k --attn-info 0 --modes barrier --methods cpmeta cpmeta-tdict floor \
      --steps 200 --budget 3 --out "$OUT/h200_broadcast_nccl.collective-$T.json"
    TAILN=10 step bcast_nccl_dev_$T 100 env PYTHONPATH="$ROOT" python3 "$ROOT/scripts/bench_broadcast.py" --backend nccl \
      --md-on-device --worlds $W --payloads decode-256 prompt-8k --attn-info 0 --modes barrier --methods cpmeta floor \
      --steps 200 --budget 3 --out "$OUT/h200_broadcast_nccl.collective-dev-$T.json"
  done
  rm -f "$OUT"/*.png  # the device tool brings back at most 8 files
  ;;
timeline)  # ~4 min: replicate-defer's step as a timeline at world 8 (profile_phases.py sync: the
  # driver's stages, then the last follower's from the commit), decode-64 / mixed / prompt, plain,
  # then seed decode-64; with .alt (git archive REV | tar -x -C .alt) the same before it, for prompt
  [ -d .alt/scripts ] && (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in plain:decode-64 plain:mixed plain:prompt seed:decode-64 alt:prompt; do
    IFS=: read -r M W <<<"$V"
    ROOT=$PWD
    if [ $M = alt ]; then [ -d .alt/scripts ] || continue; ROOT=$PWD/.alt; M=plain; fi
    TAILN=3 step timeline_${V/:/_} 60 env PYTHONPATH="$ROOT" python3 "$ROOT/scripts/profile_phases.py" sync --world 8 \
      --defer --model $M --workload $W --steps 60 --out "$OUT/h200_wire.timeline-${V/:/-}.json"
  done
  ;;
knobs)  # ~5 min (~7 with .alt2): replicate-defer's decode-64 step as a timeline at world 8 (plain), this
  # tree against .alt (git archive REV | tar -x -C .alt) and an experiment tree in .alt2, if carried, in
  # turn, and this tree with the followers parking at once (CPMETA_SHM_SPIN_US=0: begin_step's announce
  # wakes them) or not warming while they spin (CPMETA_WARM=0)
  for A in .alt .alt2; do [ -d $A/scripts ] && (cd $A && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()'); done
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in alt:1 this:1 alt2:1 spin0:1 warm0:1 alt2:2 this:2 alt:2; do
    IFS=: read -r K N <<<"$V"
    ROOT=$PWD; ENVS=""
    case $K in alt|alt2) [ -d .$K/scripts ] || continue; ROOT=$PWD/.$K;; spin0) ENVS="CPMETA_SHM_SPIN_US=0";;
      warm0) ENVS="CPMETA_WARM=0";; esac
    TAILN=3 step knobs_${K}_$N 60 env $ENVS PYTHONPATH="$ROOT" python3 "$ROOT/scripts/profile_phases.py" sync --world 8 \
      --defer --model plain --workload decode-64 --steps 80 --out "$OUT/h200_wire.knobs-$K-$N.json"
  done
  ;;
wake)  # ~4 min: replicate-defer's decode-64 step as a timeline at world 8 (plain), this tree against
  # .alt (git archive REV | tar -x -C .alt) in turn, with the followers parked between steps
  # (CPMETA_SHM_SPIN_US=0: begin_step's announce wakes them, as after an engine's long forward pass)
  # and spinning through the gap (the default at a 3 ms gap: the announce wakes nobody)
  [ -d .alt/scripts ] && (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in alt:park this:park this:spin alt:spin alt:park2 this:park2; do
    IFS=: read -r K M <<<"$V"
    ROOT=$PWD; [ $K = alt ] && { [ -d .alt/scripts ] || continue; ROOT=$PWD/.alt; }
    ENVS=""; [ "${M#park}" != "$M" ] && ENVS="CPMETA_SHM_SPIN_US=0"
    TAILN=3 step wake_${K}_$M 70 env $ENVS PYTHONPATH="$ROOT" python3 "$ROOT/scripts/profile_phases.py" sync --world 8 \
      --defer --model plain --workload decode-64 --steps 80 --out "$OUT/h200_wire.wake-$K-$M.json"
  done
  ;;
check)  # ~6 min: the periodic replica check at world 8 (plain, a 66 MiB token history a rank:
  # --max-model-len 131072), this tree against .alt (git archive REV | tar -x -C .alt) in turn,
  # replicate-defer and the default driver (profile_phases.py sync: check steps, the steps after
  # them, the others, the verdicts' waits), then the prompt workload (check every 8 steps; twice)
  [ -d .alt/scripts ] && (cd .alt && PYTHONPATH=$PWD python3 -c 'import cpmeta.jit as j; j.warm_all()')
  python3 -c 'import cpmeta.jit as j; j.warm_all()'
  for V in alt:defer this:defer this:default alt:default alt:prompt this:prompt this:prompt2 alt:prompt2; do
    IFS=: read -r K M <<<"$V"
    ROOT=$PWD; [ $K = alt ] && { [ -d .alt/scripts ] || continue; ROOT=$PWD/.alt; }
    ARGS="--defer --workload decode-64 --steps 160 --check-every 8 --max-model-len 131072"
    [ $M = default ] && ARGS="--workload decode-64 --steps 160 --check-every 8 --max-model-len 131072"
    [ ${M%2} = prompt ] && ARGS="--defer --workload prompt --steps 96 --check-every 8"
    TAILN=4 step check_${K}_$M 90 env PYTHONPATH="$ROOT" python3 "$ROOT/scripts/profile_phases.py" sync --world 8 \
      --model plain --park-ms 2 $ARGS --out "$OUT/h200_wire.check-$K-$M.json"
  done
  ;;
short)  # ~9 min when the device time is short: the GPU tests, then compare's end-to-end step trimmed
  TAILN=8 step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or triton or graph or nccl" \
    tests/test_builders.py tests/test_builders_smoke.py tests/test_decode_inplace.py tests/test_cuda_graph.py \
    tests/test_slot_mapping.py tests/test_yoco_cp.py tests/test_mirror_metadata.py tests/test_gpu_broadcast.py \
    tests/test_slot_mapping_groups.py tests/test_kv_read_plan.py tests/test_stage_decode.py tests/test_batch_state.py \
    tests/test_decode_cp.py tests/test_decode_capacity.py tests/test_replicate_inplace.py
  TAILN=3 step attn_nccl1 60 python3 -m cpmeta.launch --backend nccl --nproc-per-node 1 --model seed --workload mixed --cp-mirror --verify --attention-check --kv-interleave 16 --steps 12 --decode-seqs 16
  [ -d .baseline/scripts ] || exit 0
  MQ=""; [ -d mq_bundle312 ] && MQ=":$PWD/mq_bundle312"
  for V in before after; do
    if [ $V = before ]; then ROOT=$PWD/.baseline; else ROOT=$PWD; fi
    TAILN=24 step step_$V 130 env PYTHONPATH="$ROOT$MQ" VLLM_TARGET_DEVICE=cpu python3 "$ROOT/scripts/bench_step.py" \
      --model plain --worlds 2 8 --workloads decode-64 decode-256 --strategies broadcast replicate mq-replicate \
      --steps 40 --warmup 6 --budget 3 --no-cold --out "$OUT/h200_step.plain.$V.json"
  done
  ;;
core)  # ~6 min: the host's core for a follower's decode step -- replay + build hot in ONE process
  # (profile_phases.py replay --build), alone and beside 7 / 15 busy cores (the clock under load),
  # then after a 3 ms gap; a world-8 follower's split read (sync --split-read), idle 3 ms / none
  lscpu | grep -E "Model name|MHz|^CPU\(s\)|Thread" ; grep MHz /proc/cpuinfo | sort | uniq -c | head -4
  TAILN=1 step core_warm 200 python3 -c "import cpmeta.jit as j; j.warm_all()"
  for B in 0 7 15; do
    for i in $(seq 1 $B); do (exec yes > /dev/null) & done
    sleep 1; [ "$B" -gt 0 ] && { grep MHz /proc/cpuinfo | sort | uniq -c | head -3; }
    for W in decode-64 decode-256; do
      TAILN=1 step core_busy${B}_$W 90 python3 scripts/profile_phases.py replay --workload $W --build --gap-ms 0 --steps 400 --out ""
    done
    [ "$B" -gt 0 ] && { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }
  done
  # the same pinned to the last core, alone and beside every other core busy, each pinned (d1207i:
  # beside 15 busy cores the unpinned process ran 1.8x faster at decode-64 -- migration, or the clock?)
  CPUS=($(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)))")); C=${CPUS[-1]}
  for B in 0 $(( ${#CPUS[@]} - 1 )); do
    for i in $(seq 0 $(( B - 1 ))); do (exec taskset -c "${CPUS[$i]}" yes > /dev/null) & done
    sleep 1
    TAILN=1 step core_pinned_busy$B 90 taskset -c "$C" python3 scripts/profile_phases.py replay --workload decode-64 --build --gap-ms 0 --steps 400 --out ""
    [ "$B" -gt 0 ] && { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }
  done
  TAILN=1 step core_gap3 90 python3 scripts/profile_phases.py replay --workload decode-64 --build --gap-ms 3 --steps 400 --out ""
  for P in 3 0; do
    TAILN=4 step core_split_park$P 150 python3 scripts/profile_phases.py sync --world 8 --defer --model plain --workload decode-64 \
      --split-read --park-ms $P --steps 250 --out ""
  done
  ;;
*)
  echo "unknown suite $SUITE: expected tests, bench-gpu, bench-cpu, compare, wire, replay, warm, rwarm, arena, warmbuild, width, widthab, spin, collective, pin, ab, prefill, timeline, knobs, check, core or short" >&2; exit 2
  ;;
esac
# one file for every log (the device tool brings back at most 8 files)
(cd "$OUT" && ls *.log >/dev/null 2>&1 && tar -czf "logs_$SUITE.tgz" *.log && rm -f *.log)
ls -la "$OUT"
