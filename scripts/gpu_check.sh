#!/usr/bin/env bash
# The one-call GPU run: the test suite with the engine on CUDA, then the benchmarks, then a table.
# Usage (on the lent GPU, from the repo root): bash scripts/gpu_check.sh
# Env: MODEL (default dummy:qwen2.5-1.5b), HF_MODES (default "eager"), OUT (default /tmp/gpu_check).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
MODEL=${MODEL:-dummy:qwen2.5-1.5b}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

echo "== tests (engine on CUDA) =="
PICOVLLM_TEST_DEVICE=cuda python3 -m pytest tests -q -x -s -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | grep -vE "it/s\]|^\s*$" | tail -25

echo "== latency (eager) =="
python3 -m picovllm.entrypoints.cli bench latency --model "$MODEL" --batch-sizes 1,8,32,128 \
    --input-len 128 --output-len 512 2>&1 | grep -v "it/s\]" | tee "$OUT/latency.log"
echo "== latency (CUDA graphs) =="
python3 -m picovllm.entrypoints.cli bench latency --model "$MODEL" --batch-sizes 1,8,32,128 \
    --input-len 128 --output-len 512 --no-enforce-eager 2>&1 | grep -v "it/s\]" | tee "$OUT/latency_graphs.log"
echo "== HF baseline (batch 1, eager; HF_MODES='eager compiled' adds torch.compile) =="
HF_FLAGS=$(for m in ${HF_MODES:-eager}; do printf -- "--hf %s " "$m"; done)
python3 -m picovllm.entrypoints.cli bench latency --model "$MODEL" --batch-sizes 1 \
    --input-len 128 --output-len 128 $HF_FLAGS 2>&1 | grep -v "it/s\]" | tee "$OUT/hf.log"
echo "== throughput =="
python3 -m picovllm.entrypoints.cli bench throughput --model "$MODEL" --max-model-len 4096 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/throughput.log"

echo "== summary =="
grep -E "passed|failed" "$OUT/tests.log" | tail -1
grep -E "^(fp32|bf16|CUDA graph|kernels vs)" "$OUT/tests.log"
python3 - "$OUT" <<'PY'
import json, sys
rows = []
for name in ("latency.log", "latency_graphs.log", "hf.log", "throughput.log"):
    for line in open(f"{sys.argv[1]}/{name}"):
        if line.startswith("{"):
            rows.append(json.loads(line))
for r in rows:
    if r["benchmark"] == "latency":
        for x in r["results"]:
            print(f"latency  {x['system']:12s} bs={x['batch']:<4d} {x['ms_per_step']:8.3f} ms/step "
                  f"{x['decode_tok_s']:10.1f} tok/s {x['bw_frac']:7.1%} of copy BW")
    else:
        print(f"throughput picovllm {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s")
PY
