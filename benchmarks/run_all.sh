#!/usr/bin/env bash
# Runs the official benchmarks behind docs/benchmarks.md, one group per call (each fits in 10 minutes on an H100).
#   OUT=dir bash benchmarks/run_all.sh decode    # MLA decode, bf16 and quantised caches
#   OUT=dir bash benchmarks/run_all.sh prefill   # prefill attention against torch SDPA, n-gram proposer
#   OUT=dir bash benchmarks/run_all.sh engine    # engine against transformers, speculative decoding
#   OUT=dir bash benchmarks/run_all.sh engine27  # decode step of a 27-layer V2-Lite-shaped checkpoint (CKPT=dir, 31 GB)
#   OUT=dir bash benchmarks/run_all.sh moe       # one MoE layer against the torch._grouped_mm sort and the floor
#   OUT=dir bash benchmarks/run_all.sh tune      # fused-MoE tile configurations → $OUT/<device>.json
#   OUT=dir bash benchmarks/run_all.sh fp8       # FP8 linear and fused MoE against bf16, V3-shaped engine step
#   OUT=dir bash benchmarks/run_all.sh tp        # tensor parallelism (2 GPUs)
#   OUT=dir bash benchmarks/run_all.sh v3        # V3 shapes under TP + EP (every GPU, ~15 min; LAYERS=61 needs 8 × H200)
#   OUT=dir bash benchmarks/run_all.sh cpu       # paged-cache memory and quantised-cache quality (no GPU needed)
# The speculative-decoding workload needs data/stdlib (scripts/prepare_data.py) for its prompt file.
set -eu
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
case ${1:-decode} in
  decode)
    python3 benchmarks/bench_mla_decode.py --out "$OUT" --variants 3
    mkdir -p "$OUT/quant"
    python3 benchmarks/bench_mla_decode.py --out "$OUT/quant" --kv bf16,fp8,fp8_ds_mla,tbq4 --variants 1 \
      --cases 16x32x32768x1,16x4x81920x1,16x32x32768x4,16x32x32768x2
    ;;
  prefill)
    python3 benchmarks/bench_prefill.py --out "$OUT"
    python3 benchmarks/bench_ngram.py --out "$OUT"
    ;;
  engine)
    python3 benchmarks/bench_engine.py --layers 12 --out "$OUT"
    [ -f data/bench/code_complete.jsonl ] || python3 benchmarks/code_edit_prompts.py --task complete \
      --files data/stdlib/files_heldout.txt --out data/bench/code_complete.jsonl
    python3 -m specmla.cli bench spec --dataset data/bench/code_complete.jsonl --batch 1 --num-prompts 32 \
      --k 1 2 3 4 --output-len 128 --modes none mtp --rounds 7 --json "$OUT/bench_spec.json"
    python3 benchmarks/bench_spec_lite.py --json "$OUT/bench_spec_lite.json"
    ;;
  engine27)
    python3 benchmarks/bench_engine.py --checkpoint-dir "${CKPT:-/tmp/specmla-v2lite-27}" --prefill --mixed --out "$OUT"
    ;;
  chunks)
    for n in "1024 2048" "4096 8192"; do
      python3 benchmarks/bench_engine.py --checkpoint-dir "${CKPT:-/tmp/specmla-v2lite-27}" --no-decode \
        --chunk-sweep $n --out "$OUT/chunks_${n// /_}"
    done
    ;;
  moe)
    python3 benchmarks/bench_moe.py --out "$OUT"
    ;;
  fp8)
    python3 benchmarks/bench_fp8.py --sections linear engine --out "$OUT"
    python3 benchmarks/bench_fp8_moe.py --out "$OUT"
    ;;
  tune)
    python3 benchmarks/tune_moe.py --out-json "$OUT/" --report "$OUT/tune_moe.json"
    ;;
  tp)
    torchrun --standalone --nproc-per-node "$(python3 -c 'import torch; print(min(4, torch.cuda.device_count()))')" \
      benchmarks/bench_allreduce.py --out "$OUT"
    python3 benchmarks/bench_tp.py --checkpoint-dir /tmp/specmla_v2lite27 --identity --out "$OUT"
    ;;
  v3)
    python3 benchmarks/bench_v3.py --layers "${LAYERS:-16}" --prompt-len 1024 --new-tokens 64 --kv fp8 auto \
      --spec none mtp1 mtp3 --spec-batches 1 8 32 --out "$OUT"
    ;;
  cpu)
    python3 benchmarks/kv_memory_report.py --json "$OUT/kv_memory_report.json"
    python3 benchmarks/kv_quant_quality.py --formats bf16,fp8,fp8-kernel,fp8_ds_mla,fp8_ds_mla-kernel,tbq4,tbq4-kernel \
      --out "$OUT"
    ;;
  *)
    echo "usage: OUT=dir bash benchmarks/run_all.sh decode|prefill|engine|engine27|chunks|moe|fp8|tune|tp|v3|cpu" >&2
    exit 2
    ;;
esac
