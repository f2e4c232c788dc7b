#!/usr/bin/env bash
# The pipeline test files with every stage spawned (TDPIPE_PREFORK=0) and forked (1), alternated, twice;
# wall time and the whole machine's CPU seconds (/proc/stat: the zygote's and the stages' included).
cd "$(dirname "$0")/../.."
cpu() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
for i in 1 2; do for pf in 0 1; do
  c0=$(cpu); t0=$(date +%s.%N)
  TDPIPE_PREFORK=$pf .venv/bin/python -m pytest tests/e2e/test_tensor_parallel_runtime.py tests/e2e/test_pipeline.py \
      tests/unit/test_lm_head_split.py -p no:cacheprovider > /tmp/ab_${pf}_$i.log 2>&1
  t1=$(date +%s.%N); c1=$(cpu)
  echo "prefork=$pf run $i: $(echo "$t1 - $t0" | bc) s wall, $(( (c1 - c0) / 100 )) s machine CPU; $(tail -1 /tmp/ab_${pf}_$i.log)"
done; done
