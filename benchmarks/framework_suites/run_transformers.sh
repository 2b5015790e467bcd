#!/usr/bin/env bash
# Run transformers' own Trainer checkpoint tests twice -- stock, and with FastPersistCallback()
# injected into EVERY Trainer (transformers_conftest.py) -- and print a side-by-side summary.
#
#   benchmarks/framework_suites/run_transformers.sh [DEST]
#
# DEST (default ~/.cache/fastpersist/transformers-tests-<ref>) receives the test sources: a sparse, shallow git
# checkout of huggingface/transformers at TRANSFORMERS_REF (default v5.24.0: tests/trainer,
# tests/fixtures and the top-level tests/*.py). The PyPI sdist of 5.24.0 does NOT ship
# tests/trainer, so git is the source. If DEST/tests/trainer already holds the tests (a
# previous run, or a copy made by hand), nothing is fetched.
#
# Environment:
#   PYTHON            interpreter with torch + transformers (default: <repo>/.venv/bin/python,
#                     else python3). Its transformers version should equal TRANSFORMERS_REF.
#   TRANSFORMERS_REF  git tag/branch of the tests (default v5.24.0)
#   PASSES            "stock fastpersist" (default), or just one of them
#   PYTEST_ARGS       extra pytest arguments (e.g. "-x" or "-k resume")
#   TIMEOUT_S         wall-clock limit of each pass (default 1500)
#   FASTPERSIST_HF_KWARGS  JSON kwargs of FastPersistCallback (see transformers_conftest.py)
# Exit status: 0 when every test that passes stock also passes with FastPersist, else 1.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
REF="${TRANSFORMERS_REF:-v5.24.0}"
DEST="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/fastpersist/transformers-tests-$REF}"
DEST="$(mkdir -p "$DEST" && cd "$DEST" && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
PASSES="${PASSES:-stock fastpersist}"
TIMEOUT_S="${TIMEOUT_S:-1500}"

# ----------------------------------------------------------------------------- 1. sources
if [[ ! -f "$DEST/tests/trainer/test_trainer_checkpointing.py" ]]; then
    echo "== fetching transformers tests at $REF into $DEST"
    rm -rf "$DEST/.tf-src"
    git clone --quiet --depth 1 --branch "$REF" --filter=blob:none --no-checkout \
        https://github.com/huggingface/transformers "$DEST/.tf-src" || {
        echo "git clone failed. The PyPI sdist of transformers 5.24.0 has no tests/trainer;" >&2
        echo "put a copy of transformers' tests/ (at $REF) into $DEST/tests and rerun." >&2
        exit 2
    }
    git -C "$DEST/.tf-src" sparse-checkout set --cone tests/trainer tests/fixtures
    git -C "$DEST/.tf-src" checkout --quiet
    mkdir -p "$DEST/tests"
    cp -a "$DEST/.tf-src/tests/." "$DEST/tests/"
    git -C "$DEST/.tf-src" rev-parse HEAD > "$DEST/tests/.transformers-commit"
fi
[[ -f "$DEST/tests/__init__.py" ]] || touch "$DEST/tests/__init__.py"
[[ -f "$DEST/tests/trainer/__init__.py" ]] || touch "$DEST/tests/trainer/__init__.py"
# FastPersist's supplementary checks run in the same tree (they import trainer_test_utils).
cp "$HERE/transformers_supplementary_test.py" "$DEST/tests/trainer/test_fastpersist_supplementary.py"

INSTALLED="$("$PYTHON" -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo none)"
echo "== python: $PYTHON (transformers $INSTALLED); tests: $REF at $DEST"
if [[ "v$INSTALLED" != "$REF" ]]; then
    echo "WARNING: installed transformers $INSTALLED differs from the tests' $REF" >&2
fi

# ----------------------------------------------------------------------------- 2. selection
# Checkpoint save / resume / rotation / best-model / JIT tests, the callback tests that save and
# resume (stateful callbacks, event flow incl. on_save), and Optuna hyperparameter search
# (per-trial run-N/checkpoint-M, _save_checkpoint(model, trial); skipped without `optuna`).
# test_trainer.py of 5.x holds no checkpoint tests any more (they moved to
# test_trainer_checkpointing.py).
TESTS=(
    tests/trainer/test_trainer_checkpointing.py
    tests/trainer/test_trainer_hyperparameter.py
    tests/trainer/test_fastpersist_supplementary.py
)
# The callback classes that exist in this version's file (later versions dropped the last two).
for cls in TrainerCallbackTest StatefulCallbackTest TrainerStateTest; do
    if grep -q "^class $cls" "$DEST/tests/trainer/test_trainer_callback.py"; then
        TESTS+=("tests/trainer/test_trainer_callback.py::$cls")
    fi
done

RESULTS="$DEST/results-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RESULTS"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
export PYTHONDONTWRITEBYTECODE=1

run_pass() {  # $1: stock | fastpersist
    local name="$1" plugin=()
    if [[ "$name" == fastpersist ]]; then
        plugin=(-p transformers_conftest)
    fi
    echo "== pass: $name"
    (cd "$DEST" && \
        PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" FASTPERSIST_REPO="$REPO" \
        FASTPERSIST_HF_REPORT="$RESULTS/$name-per-test.json" \
        timeout "$TIMEOUT_S" nice -n 10 "$PYTHON" -m pytest -p no:cacheprovider "${plugin[@]}" \
            -rfEs --tb=short --junitxml="$RESULTS/$name.xml" ${PYTEST_ARGS:-} "${TESTS[@]}") \
        > "$RESULTS/$name.log" 2>&1
    echo "   exit $? -- $(grep -E '^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$RESULTS/$name.log" | tail -1)"
    grep '^fastpersist:' "$RESULTS/$name.log" | sed 's/^/   /'
}

for p in $PASSES; do run_pass "$p"; done

# ----------------------------------------------------------------------------- 3. summary
"$PYTHON" - "$RESULTS" $PASSES <<'EOF'
import sys, xml.etree.ElementTree as ET
from collections import Counter
results, passes = sys.argv[1], sys.argv[2:]

def outcomes(path):
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        tid = f"{tc.get('classname')}::{tc.get('name')}"
        kind, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                kind, msg = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag], (child.get("message") or "")
                break
        out[tid] = (kind, msg.splitlines()[0][:150] if msg else "")
    return out

runs = {}
for p in passes:
    try:
        runs[p] = outcomes(f"{results}/{p}.xml")
    except (FileNotFoundError, ET.ParseError) as e:
        print(f"{p}: no junit report ({e})")
for p, r in runs.items():
    c = Counter(k for k, _ in r.values())
    print(f"{p:12s} total {len(r):3d}: " + ", ".join(f"{k} {c[k]}" for k in ("passed", "failed", "error", "skipped")))
if {"stock", "fastpersist"} <= runs.keys():
    s, f = runs["stock"], runs["fastpersist"]
    bad = lambda k: k in ("failed", "error")
    regress = sorted(t for t in f if bad(f[t][0]) and s.get(t, ("missing",))[0] == "passed")
    both = sorted(t for t in f if bad(f[t][0]) and bad(s.get(t, ("passed",))[0]))
    fixed = sorted(t for t in f if f[t][0] == "passed" and bad(s.get(t, ("passed",))[0]))
    print(f"\nFAIL with FastPersist, PASS stock ({len(regress)}):")
    for t in regress:
        print(f"  {t}\n      {f[t][1]}")
    print(f"\nFAIL in both passes ({len(both)}) -- environment / unrelated to FastPersist:")
    for t in both:
        print(f"  {t}\n      stock: {s[t][1]}")
    if fixed:
        print(f"\nPASS with FastPersist, FAIL stock ({len(fixed)}):")
        for t in fixed:
            print(f"  {t}")
    print(f"\nlogs and junit reports: {results}")
    sys.exit(1 if regress else 0)
print(f"\nlogs and junit reports: {results}")
EOF
