#!/usr/bin/env bash
# The GPU run: the CUDA tests, the standard benchmarks, and a short table at the end.
# Usage, from the repository root on a CUDA machine: bash scripts/gpu_check.sh [STAGE ...]
#   stages: tests latency throughput prefix offload serve overload pd structured fp8 kv servers ttft attention ncu host
#   (default: the first seven; each fits a 10-minute call)
# Env: MODEL (default dummy:qwen2.5-1.5b), OUT (default /tmp/gpu_check), ENGINE_ARGS (extra engine options),
#      TOKENIZER (structured: a tokenizer directory, e.g. the default model's, for a dummy model),
#      OVERLOAD_RATE (default 400), OVERLOAD_BUDGET (default 512): overload's arrivals a second and step budget,
#      HF_MODES (default "eager compiled": transformers at batch 1 beside the latency run),
#      TREES="A B": each benchmark runs once per source tree, taking turns (an A/B of two checkouts).
# Packages the machine lacks (the server's, the client's, NIXL's) are installed from wheels in .whl*/ folders
# when there are any, each folder into /tmp/site/FOLDER, which stays while the machine does: a call carries
# at most 64 MiB, so NIXL's wheel (57 MB) comes in a call of its own.
for d in .whl*/; do
  if ls "$d"*.whl >/dev/null 2>&1; then
    name=${d%/}; python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "/tmp/site/${name#.}" \
        "$d"*.whl || exit 1
  fi
done
for d in /tmp/site/*/; do [ -d "$d" ] && PYTHONPATH=${d%/}${PYTHONPATH:+:$PYTHONPATH}; done; export PYTHONPATH
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
MODEL=${MODEL:-dummy:qwen2.5-1.5b}
tag() { [ "$1" = . ] || echo "_$(basename "$1")"; }  # a tree's suffix for its logs ("" for the checkout)
bench() {  # bench NAME BENCHMARK [ARGS ...]: once per tree; the log of each in $OUT/NAME[_TREE].log
  local name=$1 tree tag; shift
  for tree in ${TREES:-.}; do
    tag=$(tag "$tree")
    echo "-- $name$tag"
    PYTHONPATH=$(cd "$tree" && pwd)${PYTHONPATH:+:$PYTHONPATH} python3 -P -m picovllm.entrypoints.cli bench "$@" \
        --model "$MODEL" ${ENGINE_ARGS:-} 2>&1 | grep -v "it/s\]" | tee "$OUT/$name$tag.log" | grep -v "^{"
  done
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
for stage in ${*:-tests latency throughput prefix offload serve overload}; do
  echo "== $stage =="
  case $stage in
    tests) PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PICOVLLM_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider \
               tests/test_cuda.py tests/test_kernels.py tests/test_cuda_graph.py 2>&1 | tee "$OUT/tests.log" | tail -5 ;;
    latency) bench latency latency --batch-sizes 1,8,32,128 --input-len 128 --output-len 512 --plot "$OUT/latency.png"
             bench latency_hf latency --batch-sizes 1 --input-len 128 --output-len 128 \
                 $(for m in ${HF_MODES-eager compiled}; do printf -- "--hf %s " "$m"; done) ;;
    throughput) bench throughput throughput --max-model-len 4096 ;;
    prefix) bench prefix prefix ;;
    offload) PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PICOVLLM_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider \
                 tests/test_kv_offload.py tests/test_prefix_cache.py 2>&1 | tee "$OUT/offload_tests.log" | tail -5
             bench preemption preemption ;;
    serve) bench offline64 latency --batch-sizes 64 --input-len 512 --output-len 128
           bench serve serve --concurrency 64 --input-len 512 --output-len 128 --max-num-batched-tokens 128 \
               --max-num-seqs 64 --save-dir "$OUT/serve" ;;
    overload) OVERLOAD="--max-num-batched-tokens ${OVERLOAD_BUDGET:-512} --max-num-seqs 128 --max-num-waiting 64 --input-len 512 --output-len 128"
              bench serve64 serve --concurrency 64 --num-prompts 1000 $OVERLOAD
              bench serve256 serve --concurrency 256 --request-rate ${OVERLOAD_RATE:-400} \
                  --num-prompts $((${OVERLOAD_RATE:-400} * 60)) $OVERLOAD ;;  # (a minute of arrivals above capacity)
    pd) export UCX_TLS=${UCX_TLS:-tcp,cuda_copy} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}  # (NIXL between processes)
        PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PICOVLLM_TEST_DEVICE=cuda PICOVLLM_TEST_DTYPE=bfloat16 python3 -m pytest \
            -p no:cacheprovider ${PD_TESTS:-tests/test_disaggregation.py tests/test_router.py} 2>&1 \
            | grep -v "NIXL INFO" | tee "$OUT/pd_tests.log" | tail -5
        bench pd pd --num-prompts ${PD_PROMPTS:-64} --concurrency 16 --input-len 1024 --output-len 128 ;;
    structured) bench structured structured --tokenizer "${TOKENIZER:?structured needs TOKENIZER=DIR}" \
                    --batch-size 64 --input-len 128 --output-len 256 --max-num-seqs 64 ;;
    fp8) bench latency_bf16 latency --batch-sizes 1,8,64,128,256 --input-len 128 --output-len 256
         bench latency_fp8 latency --batch-sizes 1,8,64,128,256 --input-len 128 --output-len 256 --quantization fp8 ;;
    kv) for k in auto fp8; do  # (the KV cache's dtype; a whole batch of 256 1,024-token prompts decodes once they
          # are all in, after 16 prefill steps at this budget: at the default 2,048, after 128)
          bench "latency_kv_$k" latency --batch-sizes 128,256 --input-len 1024 --output-len 256 \
              --max-num-batched-tokens 16384 --kv-cache-dtype $k
          bench "throughput_kv_$k" throughput --max-model-len 4096 --kv-cache-dtype $k
        done ;;
    servers) for n in 1 2 4; do  # (serve's HTTP processes: --api-server-count)
               bench "serve_x$n" serve --concurrency 64 --input-len 512 --output-len 128 --max-num-batched-tokens 128 \
                   --max-num-seqs 64 --api-server-count $n
             done ;;
    ttft) for n in 128 2083; do  # (a prompt's time to first token against its floor, at the default budget)
            bench "ttft_$n" latency --batch-sizes 1 --input-len $n --output-len 4 --repeat 3
          done ;;
    attention) for tree in ${TREES:-.}; do  # (the decode kernel's tiles over bf16 and FP8 caches, batch 128 and 256)
                 (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/kernels/attention_sweep.py \
                     decode_kv) 2>&1 | tee "$OUT/attention$(tag "$tree").log" | grep -v "off by\|Error"
               done ;;
    ncu) NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
         [ -n "$NCU" ] || { echo "ncu: Nsight Compute not found (set NCU=PATH)"; exit 2; }
         for tree in ${TREES:-.}; do  # (Nsight Compute on the decode kernel at batch 256: bf16's warm call, FP8's two)
           tag=$(tag "$tree")
           (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$NCU" --clock-control none \
               -k regex:_decode_partition_kernel --launch-skip 1 --launch-count 3 --section SpeedOfLight \
               --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section Occupancy \
               --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__inst_executed.sum \
               python3 benchmarks/kernels/attention_sweep.py decode_kv_once 256) > "$OUT/ncu$tag.txt" 2>&1
           grep -E "_decode_partition|Duration|DRAM Throughput|Issued Warp|Eligible Warps|Warp Cycles Per Issued|bank_conflicts|inst_executed|Achieved Occupancy|Registers Per" \
               "$OUT/ncu$tag.txt"
         done ;;
    host) for tree in ${TREES:-.}; do  # (where the engine's host time goes in bench serve's closed loop, phase by phase)
            (cd "$tree" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/host_phases.py --serve \
                --model "$MODEL") 2>&1 | grep -v "it/s\]" | tee "$OUT/host$(tag "$tree").txt" | tail -30
          done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== summary =="
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.log"))):
    name = os.path.basename(path)[:-4]
    for r in (json.loads(line) for line in open(path) if line.startswith("{")):
        if r["benchmark"] == "latency":
            for x in r["results"]:
                print(f"{name:20s} {x['system']:10s} batch {x['batch']:<4d} {x['ms_per_step']:7.3f} ms/step "
                      f"{x['decode_tok_s']:9.0f} tok/s {x['bw_frac']:6.1%} of copy bandwidth; TTFT {x['ttft_ms']:.1f} ms "
                      f"({x['ttft_x_floor']:.1f}x floor, prompt {r['input_len']})")
        elif r["benchmark"] == "throughput":
            print(f"{name:20s} {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s")
        elif r["benchmark"] == "offload_multi_turn":
            for tier in ("off", "on"):
                x = r[tier]
                print(f"{name:20s} multi-turn, host tier {tier:3s}: hit rate {x['hit_rate']:.1%}, TTFT mean "
                      f"{x['ttft_ms']['mean']:.1f} p99 {x['ttft_ms']['p99']:.1f} ms, wall {x['wall_s']:.2f} s")
            on = r["on"]
            print(f"{name:20s} promotion {on['promote_gb_s']:.1f} GB/s against a pinned copy's {on['h2d_gb_s']:.1f}; "
                  f"copies held the compute stream {on['copy_share']:.1%} of the wall time")
        elif r["benchmark"] == "offload_preemption":
            for x in r["results"]:
                print(f"{name:20s} preemption {x['preemption_mode']:9s} {x['output_tok_s']:.0f} output tok/s, "
                      f"latency p50 {x['latency_ms']['p50']:.0f} p99 {x['latency_ms']['p99']:.0f} ms")
        elif r["benchmark"] == "prefix":
            for x in r["results"]:
                print(f"{name:20s} {x['scenario'][:2]} warm TTFT x{x['warm_ttft_speedup']:.2f}, "
                      f"wall on vs off {x['wall_on_vs_off']:+.1%}, hit rate {x['hit_rate_on']:.0%}")
        elif r["benchmark"] == "pd":
            for path, t in r["transfer"].items():
                print(f"{name:20s} {t['transfer_len']}-token KV over {path}: {t['transfer_ms']:.2f} ms, "
                      f"{t['transfer_gb_s']:.2f} GB/s, {t['transfer_of_prefill']:.1%} of prefill")
            for setup in ("colocated", "pd"):
                s = r[setup]
                print(f"{name:20s} {setup:9s} TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
                      f"ITL p50 {s['itl_ms']['p50']:.2f} p99 {s['itl_ms']['p99']:.2f} ms")
        elif r["benchmark"] == "serve":
            print(f"{name:20s} {r['output_tok_s']:.0f} output tok/s, TTFT p50 {r['ttft_ms']['p50']:.1f} ms, "
                  f"ITL p50 {r['itl_ms']['p50']:.2f} p99 {r['itl_ms']['p99']:.2f} ms; {r['requests']} requests, "
                  f"{r['rejected_503']} 503s, {r['server_errors']} other 5xx; after: {r.get('engine_after')}")
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in r.get("cpu_ms_per_step", {}).items())
            print(f"{name:20s} CPU ms per step: {cpu}")
        elif r["benchmark"] == "structured":
            a, b = r["runs"]
            print(f"{name:20s} {a['ms_per_step']:.3f} ms/step unconstrained, {b['ms_per_step']:.3f} under a JSON schema "
                  f"(x{b['vs_unconstrained']:.3f}); a typical schema compiles in {r['typical_schema_compile_ms']:.1f} ms")
PY
