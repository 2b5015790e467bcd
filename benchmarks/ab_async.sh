#!/bin/bash
# Alternated A/B of `fastpersist bench --async` between two checkouts of this repository
# (each with its native module built), so a change to the pipeline is compared with the
# code before it in the same hour: rounds alternate which tree runs first, each run is
# one round of MODES (default none,disk,overlap), and each run's per-round lines are
# printed side by side.
#
#   bash benchmarks/ab_async.sh OLD_TREE NEW_TREE [ROUNDS] [MODES] [DIR]
#
# e.g. git clone -q . /tmp/old && (cd /tmp/old && git checkout <commit> &&
#      ../main/.venv/bin/python setup.py build_ext --inplace)
#      bash benchmarks/ab_async.sh /tmp/old "$PWD" 6
#
# benchmarks/regenerate.py --only overlap-ab reruns the A/B kept in
# benchmarks/results/overlap-ab.txt, the two commits it compared unpacked and built.
set -euo pipefail
old=$1 new=$2 rounds=${3:-6} modes=${4:-none,disk,overlap} dir=${5:-./bench-out/ab-async}
py=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
out=$(mktemp -d)
run() {  # tree label
  (cd "$1" && "$py" -c "import sys; from fp_core.tools.cli import main; sys.exit(main(sys.argv[1:]))" \
     bench --async --dir "$dir" --modes "$modes" --iters 4 --warmup 2 --rounds 1) > "$out/$2.txt" 2>&1
  echo "$2: step without checkpoints $(awk '/^no checkpoint/ {print $3}' "$out/$2.txt") s;" \
       "$(sed -n '/^slowdown per round/,/^Targets/p' "$out/$2.txt" | grep -E '^  [a-z]+: ' | tr -s ' ' | tr '\n' ';')"
}
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then run "$new" "new$r"; run "$old" "old$r"; else run "$old" "old$r"; run "$new" "new$r"; fi
done
echo "full outputs: $out"
