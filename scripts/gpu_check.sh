#!/usr/bin/env bash
# The GPU run: the test suite with the engine on CUDA, the benchmarks, then a short table.
# Usage (on the lent GPU, from the repo root): bash scripts/gpu_check.sh [STAGE ...]
#   stages: tests latency throughput prefix serve (default: these; each fits one 10-minute call),
#   tests_fast: the tests stage without the two transformers parity tests (about 300 s),
#   tests_engine: the rest of the test suite with the engine on CUDA,
#   sweeps: benchmarks/attention_sweep.py (prefill tiles and key splits; decode splits in mixed steps; the tensor-core
#   GEMV at 40 rows, gemv_sweep.py 40, lost to cuBLAS at every projection in the seventh session and is not run),
#   gemv_rows: latency at batch 8/32/64 and the warm prefix hit with the fused GEMV from two rows against cuBLAS,
#   serve_steps: the engine alone under the serving benchmark's closed loop at budgets 128, 192, 512
#   (profile_decode.py serve: step intervals, and what the slowest 1% of steps carry),
#   serve_host: the same loop at budget 128, then a cProfile of 300 steps (where the host time per step goes),
#   gemv_chain: the one-row GEMV's tiles as a batch-1 step runs them (gemv_sweep.py chain, about 3 minutes),
#   serve_budgets: the serving benchmark at step budgets 512 (also with the engine on a thread), 256, 192, 128
#   warm: a warm prefix hit's time line (host phases, GPU time) with PDL on, then its kernels with PDL off,
#   serve_target: the offline decode step at batch 64 and three serving runs at budget 128 (the serving issue's
#   target). RUNS=N runs; PROMPTS=N requests a run (default 1000, as vLLM's bench serve); TREES="DIR ...": each run
#   once per source tree, taking turns (an A/B of branches checked out under .diag),
#   pdl: latency with programmatic dependent launch (the default) against without it (PICOVLLM_PDL=0)
#   and ab: the defaults against async scheduling and mixed-step graphs off (latency at batch 1
#   and 128, throughput, serving), one 10-minute call
# Env: MODEL (default dummy:qwen2.5-1.5b), HF_MODES (default "eager compiled": transformers as shipped and with its
#      static cache compiled by generate), OUT (default /tmp/gpu_check),
#      ENGINE_ARGS (extra engine options for every benchmark, e.g. "--mixed-graph-tokens 0").
# The lent H200 lacks the server's packages: carry them as wheels in .whl/ (see benchmarks/README.md);
# they are installed into /tmp/site when present.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
MODEL=${MODEL:-dummy:qwen2.5-1.5b}
STAGES=${*:-tests latency throughput prefix serve}
BENCH_CMD=(python3 -m picovllm.entrypoints.cli bench)
bench() { "${BENCH_CMD[@]}" "$1" "${@:2}" ${ENGINE_ARGS:-}; }
offline64() {  # the offline decode step at the serving benchmark's batch and lengths (its ITL's yardstick)
  bench latency --model "$MODEL" --batch-sizes 64 --input-len 512 --output-len 128 2>&1 | grep -v "it/s\]" \
      | tee "$OUT/offline64.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

for stage in $STAGES; do
  case $stage in
    tests)
      echo "== GPU tests: parity, kernels, graphs, async scheduling =="
      PICOVLLM_TEST_DEVICE=cuda python3 -m pytest tests/test_cuda.py tests/test_kernels.py tests/test_cuda_graph.py \
          -s -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/tests.log" \
          | grep -E "passed|failed|FAILED|Error|^[0-9.]+s (call|setup)|^(fp32|bf16|CUDA graph|kernels vs|fused|trained|mixed|async)" | tail -30 ;;
    tests_fast)
      echo "== GPU tests without the transformers parity tests (fp32 parity, bf16 logits: ~170 s of the 480) =="
      PICOVLLM_TEST_DEVICE=cuda python3 -m pytest tests/test_cuda.py tests/test_kernels.py tests/test_cuda_graph.py \
          -k "not test_fp32_greedy_parity and not test_bf16_logits_and_greedy" \
          -s -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/tests_fast.log" \
          | grep -E "passed|failed|FAILED|Error|^[0-9.]+s (call|setup)|^(CUDA graph|kernels vs|fused|trained|mixed|async|bf16 on)" | tail -30 ;;
    tests_engine)
      echo "== the rest of the suite with the engine on CUDA =="
      PICOVLLM_TEST_DEVICE=cuda python3 -m pytest tests -p no:cacheprovider --ignore=tests/test_cuda.py \
          2>&1 | tee "$OUT/tests_engine.log" | grep -E "passed|failed|FAILED|Error" | tail -30 ;;
    latency)
      echo "== latency: CUDA graphs (the default), HF baselines =="
      bench latency --model "$MODEL" --batch-sizes 1,8,32,128 --input-len 128 --output-len 512 \
          --plot "$OUT/latency_graphs.png" 2>&1 | grep -v "it/s\]" | tee "$OUT/latency_graphs.log"
      HF_FLAGS=$(for m in ${HF_MODES:-eager compiled}; do printf -- "--hf %s " "$m"; done)
      bench latency --model "$MODEL" --batch-sizes 1 --input-len 128 --output-len 128 \
          $HF_FLAGS 2>&1 | grep -v "it/s\]" | tee "$OUT/hf.log" ;;
    throughput)
      echo "== throughput =="
      bench throughput --model "$MODEL" --max-model-len 4096 2>&1 | grep -v "it/s\]" \
          | tee "$OUT/throughput.log" ;;
    prefix)
      echo "== prefix caching =="
      bench prefix --model "$MODEL" 2>&1 | grep -v "it/s\]" | tee "$OUT/prefix.log"
      echo "-- where a warm hit's GPU time goes (scenario b) --"
      python3 benchmarks/profile_decode.py prefix 2>&1 | grep -E "^warm|^timeline|us/step" | head -13 | tee "$OUT/prefix_profile.log" ;;
    warm)
      echo "== a warm prefix hit (scenario b): its time line with the engine's defaults, then its kernels (PDL off) =="
      PICOVLLM_PDL=1 python3 benchmarks/profile_decode.py prefix 2>&1 | grep -E "^timeline" | tee "$OUT/warm.log"
      python3 benchmarks/profile_decode.py prefix 2>&1 | grep -E "^warm|^timeline|us/step" | head -24 | tee -a "$OUT/warm.log" ;;
    serve)
      echo "== serving (and the offline decode step at the same batch size, for its ITL) =="
      offline64
      bench serve --model "$MODEL" --concurrency 64 --num-prompts 256 --input-len 512 \
          --output-len 128 --save-dir "$OUT" 2>&1 | grep -v "it/s\]" | tee "$OUT/serve.log"
      echo "-- a serving step offline: 64 decodes + a 192-token prompt chunk --"
      python3 benchmarks/profile_decode.py mixed 64 192 2>&1 | grep -E "^mixed|us/step" | head -6 | tee "$OUT/mixed_profile.log"
      ;&
    serve_budgets)
      # smaller step budgets (prompt chunks stall the streams less); the engine on a thread of the server's process
      for opts in "--max-num-batched-tokens 512" "--max-num-batched-tokens 512 --disable-frontend-multiprocessing" \
                  "--max-num-batched-tokens 256" "--max-num-batched-tokens 192 --max-num-seqs 64" \
                  "--max-num-batched-tokens 128 --max-num-seqs 64"; do
        name=serve_b$(echo "$opts" | cut -d' ' -f2)$([[ $opts == *disable-frontend* ]] && echo _thread)
        bench serve --model "$MODEL" --concurrency 64 --num-prompts 256 --input-len 512 --output-len 128 $opts \
            2>&1 | grep -v "it/s\]" | tee "$OUT/$name.log" | grep -E "ITL|TTFT|engine step|rror"
      done ;;
    serve_target)
      echo "== the serving issue's target: p99 ITL within 1.5x of the offline decode step at batch 64 (three serving runs) =="
      offline64 | grep -E "^picovllm"
      for run in $(seq "${RUNS:-3}"); do
        for tree in ${TREES:-.}; do  # source trees taking turns (A/B of branches: TREES=". .diag/branch")
          tag=$([ "$tree" = . ] || echo "_$(basename "$tree")")
          PYTHONPATH=$(cd "$tree" && pwd):$PYTHONPATH bench serve --model "$MODEL" --concurrency 64 --num-prompts "${PROMPTS:-1000}" \
              --input-len 512 --output-len 128 --max-num-batched-tokens 128 --max-num-seqs 64 \
              --save-dir "$OUT/serve_b128_run$run$tag" 2>&1 | grep -v "it/s\]" \
              | tee "$OUT/serve_b128_run$run$tag.log" | grep -E "ITL|TTFT|engine step|rror"
        done
      done ;;
    pdl)
      echo "== programmatic dependent launch (the default) against without it (PICOVLLM_PDL=0) =="
      for pdl in 0 1; do
        PICOVLLM_PDL=$pdl bench latency --model "$MODEL" --batch-sizes 1,8,32,128 --input-len 128 --output-len 256 2>&1 \
            | grep -v "it/s\]" | tee "$OUT/ab_pdl$pdl.log" | grep -E "^picovllm"
      done
      python3 benchmarks/profile_decode.py 1 graphs 2>&1 | grep -E "^decode|us/step" | head -8 ;;
    sweeps)
      echo "== kernel sweeps: prefill attention tiles and key splits, decode splits in mixed steps =="
      python3 benchmarks/attention_sweep.py 2>&1 | tee "$OUT/attention_sweep.log"
      python3 benchmarks/attention_sweep.py decode 2>&1 | tee "$OUT/decode_sweep.log" ;;
    serve_steps)
      echo "== the engine alone under the serving loop: step intervals and what the slowest steps carry =="
      for budget in 128 192 512; do
        python3 benchmarks/profile_decode.py serve $budget 64 2>&1 | grep -E "^serving|^  " | tee -a "$OUT/serve_steps.log"
      done ;;
    serve_host)
      echo "== where the host time of a serving step goes (budget 128, 64 clients; cProfile over 300 steps) =="
      python3 benchmarks/profile_decode.py serve 128 64 host 2>&1 | grep -E "^serving|^  |tottime|^ +[0-9]" | head -40 \
          | tee "$OUT/serve_host.log" ;;
    gemv_rows)
      echo "== the fused tensor-core GEMV from two rows (PICOVLLM_GEMV_MAX_ROWS=64; down stays on cuBLAS) against cuBLAS =="
      for rows in 1 64 1 64; do
        PICOVLLM_GEMV_MAX_ROWS=$rows bench latency --model "$MODEL" --batch-sizes 8,32,64 --input-len 128 --output-len 256 \
            2>&1 | grep -E "^picovllm" | sed "s/^/gemv rows $rows: /" | tee -a "$OUT/gemv_rows.log"
        PICOVLLM_GEMV_MAX_ROWS=$rows PICOVLLM_PDL=1 python3 benchmarks/profile_decode.py prefix 2>&1 | grep -E "^warm" \
            | sed "s/^/gemv rows $rows: /" | tee -a "$OUT/gemv_rows.log"
      done ;;
    gemv_chain)
      echo "== one-row GEMV tiles, a whole step's GEMVs graphed =="
      python3 benchmarks/gemv_sweep.py chain 2>&1 | tee "$OUT/gemv_chain.log" ;;
    ab)
      echo "== the defaults against the engine with async scheduling and mixed-step graphs off =="
      for cfg in "sync_eager_mixed:--no-async-scheduling --mixed-graph-tokens 0" "sync:--no-async-scheduling" "defaults:"; do
        name=${cfg%%:*}; args=${cfg#*:}
        ENGINE_ARGS="$args" bench latency --model "$MODEL" --batch-sizes 1,128 --input-len 128 --output-len 256 2>&1 \
            | grep -v "it/s\]" | tee "$OUT/ab_latency_$name.log" | grep -E "^picovllm"
        ENGINE_ARGS="$args" bench throughput --model "$MODEL" --max-model-len 4096 2>&1 | grep -v "it/s\]" \
            | tee "$OUT/ab_throughput_$name.log" | grep -E "^picovllm"
        [ "$name" = sync ] && continue  # serving (budget 512 for all): the defaults and neither option
        ENGINE_ARGS="$args --max-num-batched-tokens 512" bench serve --model "$MODEL" --concurrency 64 \
            --num-prompts 256 --input-len 512 --output-len 128 2>&1 | grep -v "it/s\]" | tee "$OUT/ab_serve_$name.log" \
            | grep -E "ITL|TTFT"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done

echo "== summary =="
python3 - "$OUT" <<'PY'
import json, os, sys
names = ["latency_graphs.log", "hf.log", "offline64.log", "throughput.log", "prefix.log", "serve.log"]
names += sorted(n for n in os.listdir(sys.argv[1]) if n.startswith(("serve_b", "ab_")) and n.endswith(".log"))
offline64 = None
if os.path.exists(os.path.join(sys.argv[1], "offline64.log")):
    for line in open(os.path.join(sys.argv[1], "offline64.log")):
        if line.startswith("{"):
            offline64 = json.loads(line)["results"][0]["ms_per_step"]
for name in names:
    path = os.path.join(sys.argv[1], name)
    if not os.path.exists(path):
        continue
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["benchmark"] == "latency":
            for x in r["results"]:
                print(f"{name:20s} {x['system']:10s} bs={x['batch']:<4d} {x['ms_per_step']:8.3f} ms/step "
                      f"{x['decode_tok_s']:10.1f} tok/s {x['bw_frac']:7.1%} of copy BW")
        elif r["benchmark"] == "throughput":
            print(f"{name:20s} throughput: {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s")
        elif r["benchmark"] == "prefix":
            for x in r["results"]:
                print(f"prefix {x['scenario'][:2]} warm TTFT x{x['warm_ttft_speedup']:.2f}, "
                      f"wall on vs off {x['wall_on_vs_off']:+.1%}, hit {x['hit_rate_on']:.0%}")
            print(f"prefix match+insert {r['match_insert_us']:.1f} us")
        elif r["benchmark"] == "serve":
            if offline64 and name.startswith("serve_b128"):
                print(f"{name:20s} p99 ITL / offline batch-64 step: {r['itl_ms']['p99'] / offline64:.3f} (target at most 1.5)")
            print(f"{name:20s} serve: {r['output_tok_s']:.0f} output tok/s, ITL p50 {r['itl_ms']['p50']:.2f} "
                  f"p99 {r['itl_ms']['p99']:.2f} ms, TTFT p99 {r['ttft_ms']['p99']:.1f} ms"
                  + (f", engine step p99 {r['engine_step_ms']['p99']:.2f} ms" if "engine_step_ms" in r else "")
                  + (f" (in its process {r['engine_process_step_ms']['p99']:.2f}, send to delivery "
                     f"{r['engine_to_server_ms']['p99']:.2f})" if "engine_process_step_ms" in r else ""))
            if "engine_process_slow_steps" in r:
                s = r["engine_process_slow_steps"]
                print(f"{name:20s} engine process: {s['slow']} of {s['steps']} steps slow (at most {s['longest_run']} in a row); "
                      f"OS preemptions: " + ", ".join(f"{k} {n}" for k, n in r["preemptions"].items()))
                late = r["late_outputs"]
                print(f"{name:20s} outputs in late steps: {late['late']} of {late['outputs']} "
                      f"({late['late'] / max(late['outputs'], 1):.2%}; p99 needs < 1%), late in the engine process: {late['engine_late']}")
PY
