#!/usr/bin/env bash
# Repeats of the small-batch grid (batch 1, 4, 16; no shared-block rows, no host figures), the cluster
# merge (the default) and the merge kernel (MSA_JIT_ENABLE_CLUSTER_MERGE=0) in alternation, so that the
# run-to-run spread of one machine is measured beside their difference (session 24: one point of the
# H200 bench had the cluster merge 0.9% slower). Environment: bench/device_env.sh; results:
# $OUT/merge-ab-<date>-<gpu>.json (bench/merge_ab_summary.py: both sides per point, ratio, spread) and
# the runs' own files as one tarball.
#   ROUNDS=2 bash bench/merge_ab.sh
set -uo pipefail
source bench/device_env.sh
unset MSA_JIT_ENABLE_SM90_UNION  # the planner's rule (its union takes no grid under a wave: none here)
for round in $(seq 1 "${ROUNDS:-2}"); do
  for merge in cluster kernel; do
    d=$OUT/merge-ab/$round-$merge; mkdir -p "$d"
    MSA_JIT_ENABLE_CLUSTER_MERGE=$([ $merge = cluster ] && echo 1 || echo 0) timeout "${STEP_SECONDS:-90}" \
      python3 -m msa_jit bench --out "$d" --batches 1,4,16 --no-shared --no-host --baseline none > "$d/bench.log" 2>&1
    echo "round $round $merge rc=$?"
  done
done
python3 bench/merge_ab_summary.py $OUT/merge-ab --out $OUT | tail -n 3
tar czf $OUT/merge-ab.tgz -C $OUT merge-ab && rm -rf $OUT/merge-ab
