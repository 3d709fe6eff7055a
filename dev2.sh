export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$(mktemp -d)
export TBQ4REG=1
python3 benchmarks/ncu_once.py 16 32 32768 1 gluon tbq4 >/dev/null 2>&1
timeout 400 ncu --clock-control none --set full --import-source no -k regex:tbq4reg -c 1 -o $OUT/tbq4reg \
  python3 benchmarks/ncu_once.py 16 32 32768 1 gluon tbq4 > $OUT/ncu.log 2>&1; tail -3 $OUT/ncu.log
ncu --import $OUT/tbq4reg.ncu-rep --page details > $OUT/details.txt 2>&1
ncu --import $OUT/tbq4reg.ncu-rep --page source --print-source sass --csv > $OUT/sass.csv 2>&1
ls -la $OUT; grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Shared|Issued Warp|Stall|Bank" $OUT/details.txt | head -40
rm -f $OUT/tbq4reg.ncu-rep
