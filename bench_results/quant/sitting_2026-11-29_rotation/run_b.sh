# After run.sh: the rotated quantise pass's row copy vectorised (it had called ops.cpp's ld per value) and the
# butterflies' in-register permutes made cheaper; rotated (this code) against unrotated (OLD, as in run.sh),
# alternated, each a fresh process.
#   bash bench_results/quant/sitting_2026-11-29_rotation/run_b.sh
set -u
cd "$(dirname "$0")/../../.."
D=bench_results/quant/sitting_2026-11-29_rotation
P=b_
. bench_results/quant/sitting.sh  # tdp, vl
for run in rotated_1 unrotated_1 unrotated_2 rotated_2; do
    echo "$run"; case $run in unrotated*) tdp w8a8 "$run" "$OLD" ;; *) tdp w8a8 "$run" "" ;; esac
done
