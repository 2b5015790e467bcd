#!/usr/bin/env bash
# Run Lightning's own checkpoint-related tests twice -- stock, and with FastPersistIO swapped in as
# the default CheckpointIO of every strategy (lightning_conftest.py) -- and summarise the difference.
#
#   benchmarks/framework_suites/run_lightning.sh [WORKDIR]
#
# WORKDIR (default: /tmp/fastpersist-lightning-tests) receives Lightning's tests, the pinned pytest,
# the logs (WORKDIR/results/{stock,swap,import}.log) and JUnit XML files. Nothing in the repo changes.
#
# Environment:
#   PYTHON               interpreter (default: <repo>/.venv/bin/python); must have lightning installed
#   SUITE                core | full (default: full; core is the minimal list, ~5 min per run)
#   TESTS                explicit, space-separated test paths/node ids (overrides SUITE)
#   MODES                runs to make (default: "stock swap"; "" = none, just fetch and summarise)
#   REUSE                1: keep the results of a mode whose results/<mode>.xml exists (default 0)
#   ATTRIBUTE            1 (default): rerun the swap-only failures with FASTPERSIST_LIGHTNING_SWAP=import
#                        (fp_integrations.lightning imported, no swap) to separate import side effects
#   LIGHTNING_SRC        existing Lightning source tree (with tests/tests_pytorch) to copy the tests from
#   LIGHTNING_GIT_DIR    a local clone or bare mirror of the Lightning repo: `git archive` of the ref
#   LIGHTNING_GIT_URL    git URL (default: https://github.com/Lightning-AI/pytorch-lightning.git)
#   LIGHTNING_TESTS_REF  tag/branch of the tests (default: the installed version's tag, else the newest
#                        tag of the same minor release below it: 2.6.6 has no tag -> 2.6.5, whose
#                        checkpoint code is identical; 2.6.6 only changed core/saving.py)
#   FASTPERSIST_IO_KWARGS  JSON kwargs of the swapped-in FastPersistIO (see lightning_conftest.py)
#   TIMEOUT              per-test timeout in seconds (default 300)
#   PYTEST_EXTRA         extra pytest arguments (e.g. "-x" or "-k checkpoint")
set -euo pipefail
{  # parsed as a whole before it runs: editing this file during a run cannot derail it

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
REPO="$(cd "$HERE/../.." && pwd -P)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
WORK="${1:-${TMPDIR:-/tmp}/fastpersist-lightning-tests}"
SUITE="${SUITE:-full}"
MODES="${MODES-stock swap}"
ATTRIBUTE="${ATTRIBUTE:-1}"
TIMEOUT="${TIMEOUT:-300}"
GIT_URL="${LIGHTNING_GIT_URL:-https://github.com/Lightning-AI/pytorch-lightning.git}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK" "$WORK/results"
WORK="$(cd "$WORK" && pwd -P)"
RESULTS="$WORK/results"
log() { printf '\n== %s\n' "$*" >&2; }

VERSION="$("$PYTHON" -c 'import lightning; print(lightning.__version__)')"
FP_REV="$(git -C "$REPO" describe --always --dirty 2>/dev/null || echo unknown)"
log "lightning $VERSION ($PYTHON), FastPersist $FP_REV, tests into $WORK"

# ---------------------------------------------------------------- 1. Lightning's test sources
have_tests() { [[ -d "$WORK/tests/tests_pytorch" && -f "$WORK/pyproject.toml" ]]; }

copy_from_tree() {  # $1: a Lightning source tree
  mkdir -p "$WORK/tests"
  cp -a "$1/tests/tests_pytorch" "$WORK/tests/"
  [[ -d "$1/tests/legacy" ]] && cp -a "$1/tests/legacy" "$WORK/tests/"
  cp "$1/pyproject.toml" "$WORK/"
  [[ -d "$1/requirements" ]] && cp -a "$1/requirements" "$WORK/"
  return 0
}

from_sdist() {  # the PyPI sdist, if it ships the tests (lightning's does not, as of 2.6.6)
  local d; d="$(mktemp -d)"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "lightning==$VERSION" -d "$d" >/dev/null 2>&1 || { rm -rf "$d"; return 1; }
  local tgz; tgz="$(ls "$d"/*.tar.gz 2>/dev/null | head -1)"
  if [[ -n "$tgz" ]] && tar tzf "$tgz" | grep -q '/tests/tests_pytorch/conftest.py$'; then
    tar xzf "$tgz" -C "$d" && copy_from_tree "$d"/lightning-*/ && rm -rf "$d" && return 0
  fi
  log "PyPI sdist lightning==$VERSION has no tests/tests_pytorch"
  rm -rf "$d"; return 1
}

pick_ref() {  # the installed version's tag, else the newest lower patch tag of the same minor
  if [[ -n "${LIGHTNING_TESTS_REF:-}" ]]; then echo "$LIGHTNING_TESTS_REF"; return; fi
  git ls-remote --tags --refs "$GIT_URL" 2>/dev/null | sed 's#.*refs/tags/##' | "$PYTHON" -c '
import sys
want = tuple(int(x) for x in sys.argv[1].split("+")[0].split(".")[:3])
best = None
for t in sys.stdin.read().split():
    try:
        v = tuple(int(x) for x in t.split("."))
    except ValueError:
        continue
    if len(v) == 3 and v[:2] == want[:2] and v <= want and (best is None or v > best[0]):
        best = (v, t)
print(best[1] if best else "")' "$VERSION"
}

from_git_dir() {  # a local clone / bare mirror: git archive of the tests only
  local ref; ref="$(GIT_URL="$LIGHTNING_GIT_DIR" pick_ref)"
  [[ -n "$ref" ]] || { log "no tag for $VERSION in $LIGHTNING_GIT_DIR"; return 1; }
  [[ "$ref" == "$VERSION" ]] || log "no tag $VERSION: using tests of $ref (set LIGHTNING_TESTS_REF to override)"
  git --git-dir="$(git -C "$LIGHTNING_GIT_DIR" rev-parse --absolute-git-dir)" archive --format=tar "$ref" \
    tests/tests_pytorch tests/legacy pyproject.toml requirements | tar x -C "$WORK"
  echo "$ref" > "$WORK/LIGHTNING_TESTS_REF"
}

from_git() {
  local ref; ref="$(pick_ref)"
  [[ -n "$ref" ]] || { log "no tag for $VERSION at $GIT_URL"; return 1; }
  [[ "$ref" == "$VERSION" ]] || log "no tag $VERSION: using tests of $ref (set LIGHTNING_TESTS_REF to override)"
  local d="$WORK/.src"
  rm -rf "$d"
  git clone -q --depth 1 --branch "$ref" --filter=blob:none --no-checkout "$GIT_URL" "$d" 2>/dev/null \
    || git clone -q --depth 1 --branch "$ref" --no-checkout "$GIT_URL" "$d"
  git -C "$d" sparse-checkout set --no-cone /tests/tests_pytorch/ /tests/legacy/ /pyproject.toml /requirements/
  git -C "$d" checkout -q "$ref"
  copy_from_tree "$d"
  echo "$ref" > "$WORK/LIGHTNING_TESTS_REF"
}

if have_tests; then
  log "reusing $WORK/tests"
elif [[ -n "${LIGHTNING_SRC:-}" ]]; then
  copy_from_tree "$LIGHTNING_SRC"
elif [[ -n "${LIGHTNING_GIT_DIR:-}" ]]; then
  from_git_dir
else
  from_sdist || from_git
fi
have_tests || { echo "could not get Lightning's tests" >&2; exit 1; }

# ---------------------------------------------------------------- 2. test dependencies
req_pin() {  # $1: package -> its pin in requirements/pytorch/test.txt (fallback $2)
  local f="$WORK/requirements/pytorch/test.txt" line
  line="$( [[ -f "$f" ]] && grep -E "^$1 *==" "$f" | grep -v 'python_version *<' | head -1 | sed 's/[;#].*//; s/ //g' || true)"
  echo "${line:-$1==$2}"
}
# Lightning's pinned pytest goes into a private directory (the repo venv's pytest is not touched).
# Which pytest matters: pytest >= 9.1 also captures non-propagating loggers, which hides some caplog
# failures that Lightning's own CI (pytest 9.0.2) would show.
PYDEPS="$WORK/_pydeps"
if [[ ! -d "$PYDEPS/pytest" ]]; then
  log "installing Lightning's pinned pytest into $PYDEPS"
  "$PYTHON" -m pip install -q --no-deps --target "$PYDEPS" \
    "$(req_pin pytest 9.0.2)" "$(req_pin pytest-timeout 2.4.0)" "pytest-rerunfailures==16.1"
fi
# Packages the selected tests import or need; installed into the venv only if missing.
need=()
"$PYTHON" - <<'EOF' > "$WORK/.missing" || true
import importlib.util as u
for mod, spec in [("cloudpickle", "cloudpickle>=1.3,<3.2.0"), ("sklearn", "scikit-learn>0.22.1"),
                  ("tensorboard", "tensorboard>=2.11,<2.21.0"), ("jsonargparse", "jsonargparse[signatures]>=4.39.0,<4.46.0"),
                  ("omegaconf", "omegaconf>=2.2.3,<2.4.0"), ("hydra", "hydra-core>=1.2.0,<1.4.0"),
                  ("psutil", "psutil<7.3.0")]:
    if u.find_spec(mod) is None:
        print(spec)
EOF
mapfile -t need < "$WORK/.missing"
if ((${#need[@]})); then
  log "installing test dependencies into the venv: ${need[*]}"
  "$PYTHON" -m pip install -q "${need[@]}"
fi

# ---------------------------------------------------------------- 3. legacy checkpoint "local"
# The archived legacy checkpoints (all old versions) are a separate download; we generate the
# "local" one (stock Lightning, as tests/legacy/generate_checkpoints.sh does) and run only that.
L="$WORK/tests/legacy"
if [[ -d "$L" && -z "$(ls "$L"/checkpoints/local/*.ckpt 2>/dev/null)" ]]; then
  log "generating the legacy 'local' checkpoint (stock Lightning)"
  mkdir -p "$L/checkpoints"
  ( cd "$WORK/tests" && PYTHONPATH="$WORK/tests" nice -n 10 "$PYTHON" "$L/simple_classif_training.py" local ) \
    > "$RESULTS/legacy-generate.log" 2>&1
  cp "$L/simple_classif_training.py" "$L/checkpoints/local/"
  mv "$L"/checkpoints/local/lightning_logs/version_0/checkpoints/*.ckpt "$L/checkpoints/local/"
  rm -rf "$L/checkpoints/local/lightning_logs"
fi

# ---------------------------------------------------------------- 4. the tests
CORE=(
  tests_pytorch/checkpointing
  tests_pytorch/plugins/test_checkpoint_io_plugin.py
  tests_pytorch/plugins/test_async_checkpoint.py
  tests_pytorch/trainer/connectors/test_checkpoint_connector.py
  tests_pytorch/models/test_hooks.py
  tests_pytorch/models/test_restore.py
  tests_pytorch/callbacks/test_early_stopping.py
  tests_pytorch/callbacks/test_timer.py
  tests_pytorch/callbacks/test_stochastic_weight_avg.py
  tests_pytorch/callbacks/test_callbacks.py
  tests_pytorch/trainer/flags/test_min_max_epochs.py
  tests_pytorch/loops/test_training_loop.py
)
EXTENDED=(
  tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py
  tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py
  tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py
  tests_pytorch/callbacks/test_model_checkpoint_step_interval_val_metric.py
  tests_pytorch/callbacks/test_weight_averaging.py
  tests_pytorch/callbacks/test_finetuning_callback.py
  tests_pytorch/callbacks/test_pruning.py
  tests_pytorch/core/test_saving.py
  tests_pytorch/core/test_datamodules.py
  tests_pytorch/models/test_hparams.py
  tests_pytorch/loops/test_loops.py
  tests_pytorch/loops/test_training_epoch_loop.py
  tests_pytorch/trainer/test_trainer.py
  tests_pytorch/trainer/connectors/test_signal_connector.py
)
if [[ -n "${TESTS:-}" ]]; then read -r -a SEL <<< "$TESTS"
elif [[ "$SUITE" == core ]]; then SEL=("${CORE[@]}")
else SEL=("${CORE[@]}" "${EXTENDED[@]}"); fi
EXISTING=(); for t in "${SEL[@]}"; do [[ -e "$WORK/tests/${t%%::*}" ]] && EXISTING+=("$t"); done

# -p no:rerunfailures: Lightning marks a few tests flaky(reruns=3); a rerun would hide an
# intermittent failure (a race with a background save), so every test runs exactly once.
# The -o markers line registers the markers the plugin would have (needed with --strict-markers).
PYTEST_ARGS=(-p no:cacheprovider -p no:rerunfailures -o $'markers=cloud\nflaky' --color=no
  --timeout="$TIMEOUT" -q -rfEs -k "not test_legacy or local")
read -r -a EXTRA <<< "${PYTEST_EXTRA:-}"

run_mode() {  # $1: stock | swap | import ; rest: tests
  local mode="$1"; shift
  if [[ "${REUSE:-0}" == 1 && -f "$RESULTS/$mode.xml" ]]; then log "reusing $RESULTS/$mode.xml"; return 0; fi
  local pp="$PYDEPS" plug=()
  if [[ "$mode" != stock ]]; then pp="$PYDEPS:$HERE"; plug=(-p lightning_conftest); fi
  log "run: $mode (${#@} selections) -> $RESULTS/$mode.log"
  local t0=$SECONDS rc=0
  ( cd "$WORK/tests" && FASTPERSIST_REPO="$REPO" FASTPERSIST_LIGHTNING_SWAP="$([[ $mode == import ]] && echo import || echo 1)" \
      PYTHONPATH="$pp" nice -n 10 "$PYTHON" -m pytest "${plug[@]}" "${PYTEST_ARGS[@]}" "${EXTRA[@]}" \
      --junitxml="$RESULTS/$mode.xml" "$@" ) > "$RESULTS/$mode.log" 2>&1 || rc=$?
  echo "$mode: exit $rc in $((SECONDS - t0)) s; $(tail -1 "$RESULTS/$mode.log")" >&2
  echo "$FP_REV" > "$RESULTS/$mode.fastpersist-rev"
}

for mode in $MODES; do run_mode "$mode" "${EXISTING[@]}"; done

# ---------------------------------------------------------------- 5. attribution + summary
summary() {
  "$PYTHON" - "$RESULTS" "$@" <<'EOF'
import os, sys, xml.etree.ElementTree as ET
results, modes = sys.argv[1], sys.argv[2:]

work = os.path.dirname(os.path.abspath(results))
tests_dir = os.path.join(work, "tests")

def nodeid_of(cls, name):
    """JUnit classname (dotted, relative to the rootdir) + name -> node id relative to tests/."""
    parts = cls.split(".")
    for i in range(len(parts), 0, -1):  # the module path, then classes inside it
        f = os.path.join(work, *parts[:i]) + ".py"
        if os.path.exists(f):
            return "::".join([os.path.relpath(f, tests_dir), *parts[i:], name])
    return f"{cls}::{name}"

def first_line(el):
    m = (el.get("message") or el.text or "").strip()
    return m.splitlines()[0][:170] if m else ""

def load(mode):
    path = os.path.join(results, f"{mode}.xml")
    if not os.path.exists(path):
        return None
    tags = {}  # a teardown error after a failed call comes as a second <testcase> of the same test
    for tc in ET.parse(path).getroot().iter("testcase"):
        nodeid = nodeid_of(tc.get("classname", ""), tc.get("name", ""))
        d = tags.setdefault(nodeid, {"failure": [], "error": [], "skipped": []})
        for tag in d:
            d[tag] += tc.findall(tag)
    out = {}
    for nodeid, d in tags.items():
        fail, err, skip = d["failure"], d["error"], d["skipped"]
        if fail:
            status, msg = "failed", first_line(fail[0])
            if err:  # failed in the call and again at teardown
                status, msg = "failed+error", msg + "  || teardown: " + first_line(err[0])
        elif err:
            status, msg = "error", first_line(err[0])
        elif skip:
            status, msg = "skipped", first_line(skip[0])
        else:
            status, msg = "passed", ""
        out[nodeid] = (status, msg)
    return out

runs = {m: load(m) for m in modes}
runs = {m: r for m, r in runs.items() if r is not None}
print("\n================ FastPersist x Lightning test-suite summary ================")
for m in modes:
    rev = os.path.join(results, f"{m}.fastpersist-rev")
    if os.path.exists(rev):
        print(f"{m:7s} FastPersist revision {open(rev).read().strip()}")
for m, r in runs.items():
    c = {}
    for s, _ in r.values():
        c[s] = c.get(s, 0) + 1
    print(f"{m:7s} tests={len(r)}  " + "  ".join(f"{k}={c.get(k, 0)}" for k in ("passed", "failed", "failed+error", "error", "skipped"))
          + ("   (only the swap-only failures, rerun)" if m == "import" else ""))
bad = ("failed", "error", "failed+error")
stock, swap, imp = runs.get("stock", {}), runs.get("swap", {}), runs.get("import", {})
if swap:
    only = sorted(k for k, v in swap.items() if v[0] in bad and stock.get(k, ("?",))[0] not in bad)
    both = sorted(k for k, v in swap.items() if v[0] in bad and stock.get(k, ("?",))[0] in bad)
    fixed = sorted(k for k, v in stock.items() if v[0] in bad and swap.get(k, ("?",))[0] not in bad)
    print(f"\nfail WITH the swap only ({len(only)}):")
    for k in only:
        tag = ""
        if imp:
            tag = " [also fails with import only]" if imp.get(k, ("?",))[0] in bad else (
                " [passes with import only]" if k in imp else "")
        print(f"  {swap[k][0]:12s} {k}{tag}\n               {swap[k][1]}")
    print(f"\nfail in BOTH runs (environment; {len(both)}):")
    for k in both:
        print(f"  {swap[k][0]:12s} {k}\n               {stock[k][1]}")
    if fixed:
        print(f"\nfail in the stock run only ({len(fixed)}):")
        for k in fixed:
            print(f"  {stock[k][0]:12s} {k}\n               {stock[k][1]}")
    with open(os.path.join(results, "swap_only_failures.txt"), "w") as f:
        f.write("".join(k + "\n" for k in only))
print(f"\nlogs and JUnit XML: {results}/")
EOF
}

if [[ "$ATTRIBUTE" == 1 && " $MODES " == *" swap "* && " $MODES " == *" stock "* ]]; then
  summary stock swap > /dev/null
  mapfile -t ONLY < "$RESULTS/swap_only_failures.txt"
  if ((${#ONLY[@]})); then
    run_mode import "${ONLY[@]}"
    MODES="$MODES import"
  fi
fi
summary $MODES | tee "$RESULTS/summary.txt"
exit
}
