#!/usr/bin/env bash
# Host replays for issue 42 (session 1128h): three placement/policy
# experiments, each a patch on 805ede1 applied in a scratch worktree, and
# where the free memory lies at the peak (peak_dump.rs.txt as an example).
# Usage: bash benches/results/issue42-1128h/run.sh > out.txt (from the repo root)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
wt=$(mktemp -d)/wt
git -C "$repo" worktree add -q --detach "$wt" 805ede19a0251e3e1155db8e4cca8be1539708f4
trap 'git -C "$repo" worktree remove --force "$wt"' EXIT
lt=$(mktemp -d)
for k in causal-lm:causal-lm-h200 transformer:transformer-h100; do
  python3 "$repo/benches/results/issue42-1128g/longtrace.py.txt" "$repo/traces/torch-${k#*:}.csv.gz" "$lt/${k%%:*}-long.csv.gz" "${k%%:*}" 300 1 2>/dev/null
done
traces="$repo/traces/torch-kv-decode-h200.csv.gz $repo/traces/torch-transformer-h100.csv.gz $repo/traces/torch-causal-lm-h200.csv.gz $repo/traces/torch-fsdp-h100.csv.gz $repo/traces/torch-vision-res-h200.csv.gz $repo/traces/torch-conv-h100.csv.gz $lt/causal-lm-long.csv.gz $lt/transformer-long.csv.gz"
run() {
  "$wt/target/release/examples/replay" "$1" 2>&1 | awk '/^peak/{r=$0} /chunks mapped/{print r" | "$0}' |
    sed -E 's/peak allocated ([0-9.]+) MiB, peak reserved \(mapped \+ pooled\) ([0-9.]+) MiB: ([0-9.x]+).*allocs [0-9]+, frees [0-9]+, (chunks mapped [0-9]+), (ranges unmapped [0-9]+), (chunks moved [0-9]+ in [0-9]+ growths).*/allocated \1 reserved \2 \3 \4 \5 \6/'
}
export VMMBUF_REPLAY_LAG=100 VMMBUF_RELEASE_BEFORE_MAP=0
cp "$here/peak_dump.rs.txt" "$wt/examples/peak_dump.rs"
(cd "$wt" && cargo build -q --release --example replay --example peak_dump)
echo "# where the free memory lies at the peak reserved (moves on, 2 MiB chunks, fences 100 events late; zone 0 is requests of 1 MiB or less)"
for t in kv-decode-h200 transformer-h100 causal-lm-h200 fsdp-h100 vision-res-h200 conv-h100; do
  echo "== $t"; LAG=100 "$wt/target/release/examples/peak_dump" "$repo/traces/torch-$t.csv.gz" | grep -v '^segments'
done
for exp in high-end-placement slack-without-release small-in-large; do
  git -C "$wt" checkout -q -- src
  git -C "$wt" apply "$here/$exp.diff.txt"
  (cd "$wt" && cargo build -q --release --example replay)
  echo; echo "# $exp"
  for t in $traces; do
    echo "== ${t##*/}"
    case $exp in
      high-end-placement)
        for m in 0 1 2; do echo -n "moves, VMMBUF_EXP_HIGH=$m: "; VMMBUF_MOVE_FREE=1 VMMBUF_EXP_HIGH=$m run "$t"; done ;;
      slack-without-release)
        echo -n "moves: "; VMMBUF_MOVE_FREE=1 run "$t"
        for p in 101 102; do
          echo -n "moves past $p%, releasing: "; VMMBUF_MOVE_FREE=1 VMMBUF_RELEASE_OVER=$p run "$t"
          echo -n "moves past $p%, no release: "; VMMBUF_MOVE_FREE=1 VMMBUF_EXP_NORELEASE=1 VMMBUF_RELEASE_OVER=$p run "$t"
        done ;;
      small-in-large)
        for e in 0 1 2; do echo -n "moves, VMMBUF_EXP_SMALL_IN_LARGE=$e: "; VMMBUF_MOVE_FREE=1 VMMBUF_EXP_SMALL_IN_LARGE=$e run "$t"; done
        for e in 0 1; do echo -n "no moves, VMMBUF_EXP_SMALL_IN_LARGE=$e: "; VMMBUF_MOVE_FREE=0 VMMBUF_EXP_SMALL_IN_LARGE=$e run "$t"; done ;;
    esac
  done
done
# Both patches at once (high-end placement and small requests in large-zone fragments)
git -C "$wt" checkout -q -- src
git -C "$wt" apply "$here/high-end-placement.diff.txt"
git -C "$wt" apply "$here/small-in-large.diff.txt"
(cd "$wt" && cargo build -q --release --example replay)
echo; echo "# high-end-placement and small-in-large together"
for t in $traces; do
  echo "== ${t##*/}"
  for h in 1 2; do echo -n "moves, VMMBUF_EXP_HIGH=$h VMMBUF_EXP_SMALL_IN_LARGE=1: "; VMMBUF_MOVE_FREE=1 VMMBUF_EXP_HIGH=$h VMMBUF_EXP_SMALL_IN_LARGE=1 run "$t"; done
done
# 2 MiB against 4 MiB chunks with moves on the long traces (main, no patch)
git -C "$wt" checkout -q -- src
(cd "$wt" && cargo build -q --release --example replay)
echo; echo "# chunk size with moves, long traces (main 805ede1)"
for t in $lt/causal-lm-long.csv.gz $lt/transformer-long.csv.gz; do
  echo "== ${t##*/}"
  for c in 2 4; do echo -n "moves, VMMBUF_CHUNK_MIB=$c: "; VMMBUF_MOVE_FREE=1 VMMBUF_CHUNK_MIB=$c run "$t"; done
done
echo; echo "# chunks moved in each tenth of the long causal-LM trace (the trace cut after k tenths of its lines), main 805ede1"
zcat "$lt/causal-lm-long.csv.gz" > "$lt/cl.csv"
n=$(wc -l < "$lt/cl.csv")
for c in 2 4; do
  prev=0; echo -n "VMMBUF_CHUNK_MIB=$c:"
  for k in 1 2 3 4 5 6 7 8 9 10; do
    head -n $((n * k / 10)) "$lt/cl.csv" > "$lt/cut.csv"
    m=$(VMMBUF_MOVE_FREE=1 VMMBUF_CHUNK_MIB=$c "$wt/target/release/examples/replay" "$lt/cut.csv" 2>&1 | grep -o 'chunks moved [0-9]*' | awk '{print $3}')
    echo -n " +$((m - prev))"; prev=$m
  done
  echo
done
