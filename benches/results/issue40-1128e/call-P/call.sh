#!/usr/bin/env bash
# Session 1128e call P (1x H200): hot_path (the plug-in's C entry points, context guard included),
# new binary with frees queued / not queued, and fa64703's binary, alternating.
set -u
S=$OUT/summary.txt
for r in 1 2; do
  for v in new-q new-noq old; do
    b=${v%%-*}; q=1; [ "$v" = new-noq ] && q=0
    echo "== round $r $v" >> $S
    VMMBUF_TORCH_QUEUE_FREES=$q timeout 150 .gpu/hp/$b > $OUT/hp-$r-$v.txt 2>&1
    echo "rc $? [$SECONDS s]" >> $S
    grep -E "plug-in|bind_to|Arena::alloc \+ drop, the" $OUT/hp-$r-$v.txt >> $S
  done
done
cat $S
