#!/usr/bin/env bash
# The GPU benchmark runs behind docs/benchmarks.md, one stage per device call (each fits 10 min).
#   OUT=dir bash benchmarks/gpu_session.sh kernels   # issues 6 (n-gram kernel), 7 (quantised decode), 8 (prefill)
#   OUT=dir bash benchmarks/gpu_session.sh engine    # issues 4 (engine vs transformers) and 6 (bench spec)
#   OUT=dir bash benchmarks/gpu_session.sh quant     # issue 7: the e4m3 kernels' GPU tests, the official benchmark,
#                                                    # the kernels' probes and the fp8 kernel's timeline
# Prompt files: python benchmarks/code_edit_prompts.py --out data/bench/code_edit.jsonl
#               python benchmarks/code_edit_prompts.py --task complete --files data/stdlib/files_heldout.txt \
#                      --out data/bench/code_complete.jsonl
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
stage=${1:-kernels}
spec() {  # label dataset batch ks
  timeout 200 python3 -m specmla.cli bench spec --dataset "$2" --batch $3 --num-prompts 32 --k $4 --output-len 128 \
    --modes none mtp ngram hybrid --json "$OUT/spec_$1_b$3.json" 2>&1 | grep -v Warning
}
case $stage in
  kernels)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mla_prefill_triton.py tests/test_kv_quant.py \
      tests/test_ngram.py tests/test_mla_decode_triton.py 2>&1 | tail -15
    timeout 60 python3 benchmarks/bench_ngram.py --out "$OUT" 2>&1
    timeout 240 python3 benchmarks/bench_mla_decode.py --out "$OUT" --kv bf16,fp8,tbq4 --variants 3 \
      --cases 16x32x32768x1,16x4x81920x1,16x32x32768x4 2>&1
    timeout 200 python3 benchmarks/bench_prefill.py --out "$OUT" 2>&1
    ;;
  engine)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_spec_graph.py tests/test_mla_decode_triton.py \
      tests/test_ngram.py tests/test_mtp_graph.py > "$OUT/gputests.log" 2>&1; grep -E "FAILED|passed|failed|rror" "$OUT/gputests.log" | tail -12
    timeout 120 python3 benchmarks/profile_spec_step.py --out "$OUT" 2>&1 | grep -E "^none|^mtp" | cut -c1-200
    spec complete data/bench/code_complete.jsonl 1 "1 2 3 4"
    timeout 200 python3 benchmarks/bench_engine.py --layers 12 --out "$OUT" 2>&1 | grep -v -i warn
    spec edit data/bench/code_edit.jsonl 1 "2 4"
    spec complete data/bench/code_complete.jsonl 32 "2 4"
    mkdir -p "$OUT/q"; timeout 40 python3 benchmarks/bench_mla_decode.py --out "$OUT/q" --kv bf16,tbq4 --variants 1 --cases 16x32x32768x4 2>&1 \
      | grep "^H="
    ;;
  quant)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_mla_decode_gluon_fp8reg.py \
      tests/test_mla_decode_gluon_tbq4reg.py tests/test_mla_decode_e4m3.py tests/test_tbq4_rotate.py 2>&1 | tail -8
    timeout 150 python3 benchmarks/bench_mla_decode.py --out "$OUT" --kv bf16,fp8,fp8_ds_mla,tbq4 --variants 1 \
      --cases 16x32x32768x1,16x4x81920x1,16x32x32768x4 2>&1 | grep -v -i warn
    FP8MMA_VARIANTS=bf16,fp8_reg,reg16_producer_alone,rope_int8,rope_int8_producer_alone,tbq4_reg,tbq4_copies_alone \
      timeout 190 python3 benchmarks/fp8mma_probe.py --out "$OUT" --cases 16x32x32768x1,16x4x81920x1 2>&1 | tail -3
    timeout 60 python3 benchmarks/fp8reg_timeline.py --out "$OUT" 2>&1 | tail -1
    ;;
esac
