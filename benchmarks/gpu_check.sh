#!/usr/bin/env bash
# FastPersist on a GPU (issue #16): every check a lent GPU machine should run, in one command.
#
#   bash benchmarks/gpu_check.sh
#   OUT=benchmarks/results/gpu-check bash benchmarks/gpu_check.sh   # kept beside the other results
#
# Writes a summary to $OUT/gpu-check.txt and $OUT/gpu-check.json when $OUT is set (with each
# phase's full log and the benchmarks' JSON beside them), and prints it on stdout too. No
# network; nothing is installed: the native engine is built in place (setup.py build_ext
# --inplace, or the C compiler directly) when fp_core._native does not import. Python is
# $PYTHON, else .venv/bin/python when present, else python3.
#
# Time box: FP_GPU_CHECK_BUDGET_S (default 480 s) for the whole run. Every phase runs under
# its own `timeout`, capped by what is left of the box (a phase that would get less than its
# minimum is skipped and says so); a phase that fails or times out does not stop the next.
# Phases, most important first:
#
#   setup        build the engine if needed; versions, GPU, memory, disk, engine backend
#   cuda-tests   pytest -m cuda tests/core/test_cuda.py + the process writer's pinned shared
#                arena + sharded (Lightning FSDP, HF FSDP, layout="file" under NCCL from
#                device shards)                    <= 200 s
#   bench-async  fastpersist bench --async --device cuda: MLP 14 x 8192 float32 with
#                Adam = 940M params, an 11.3 GB checkpoint after every iteration (1 s
#                steps); rows: no checkpoint, torch.save, DCP async_save, Lightning's
#                AsyncCheckpointIO, AsyncCheckpointer auto/overlap/snapshot and
#                writer='process'                                                  <= 200 s
#   bench-sync   fastpersist bench --device cuda --size 4GiB: fp_core.save/load of a CUDA
#                state dict vs torch.save+fsync / torch.load(map_location="cuda"), with
#                the engine's own rows                                              <= 90 s
#   lightning    examples/lightning_finetune.py --large --accelerator gpu            <= 75 s
#   hf           examples/hf_finetune.py --large --device cuda                       <= 75 s
#
# Without a CUDA device it says so, checks that the run would start (imports, that pytest
# collects the cuda tests, that the benchmarks' and examples' command lines parse: bench
# --dry-run, example --help) and exits 0 when those pass. Exit status: 0 when every phase
# that ran passed, 1 otherwise (the summary says which).
#
# Sizes (override with FP_GPU_ASYNC_LAYERS / _WIDTH / _DTYPE / _COMPUTE_MS / _ITERS and
# FP_GPU_SYNC_SIZE): see the "Sizes" comment below.

set -u
if [ "${1:-}" = "__setup" ]; then MODE=setup; else MODE=main; fi
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then
    PY=$REPO/.venv/bin/python
else
    PY=python3
fi
export PY REPO
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic GEMMs: stock and FastPersist runs compare

# ------------------------------------------------------------------ phase 0, run as a child
if [ "$MODE" = setup ]; then
    echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
    if "$PY" -c "import fp_core._native" 2>/dev/null; then
        echo "native engine: imports (already built)"
    else
        echo "native engine: building in place"
        if ! "$PY" setup.py -q build_ext --inplace; then
            echo "setup.py build_ext failed; compiling with the C compiler directly"
            EXT=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
            INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
            "${CC:-cc}" -O2 -std=gnu11 -shared -fPIC -I"$INC" native/*.c -o "fp_core/_native$EXT" -lpthread \
                || exit 1
        fi
        "$PY" -c "import fp_core._native" || exit 1
    fi
    "$PY" - <<'EOF' || exit 1
import importlib, json, os, shutil, sys
env = {"python": sys.version.split()[0], "executable": sys.executable, "cpus": os.cpu_count()}
missing = []
for name in ("torch", "numpy", "fsspec", "pytest", "lightning", "transformers", "accelerate", "safetensors"):
    try:
        env[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as e:  # noqa: BLE001
        env[name] = None
        missing.append(f"{name} ({type(e).__name__}: {e})")
import torch
env["cuda_available"] = torch.cuda.is_available()
env["torch_cuda"] = torch.version.cuda
env["host_memory_stats"] = hasattr(torch.cuda, "host_memory_stats")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env["gpu"] = f"{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
with open("/proc/meminfo") as f:
    env["ram_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
work = os.environ["FP_WORK"]
env["work_dir"] = work
env["work_free_gib"] = round(shutil.disk_usage(work).free / 2**30, 1)
sys.path.insert(0, os.path.join(os.environ["REPO"], "tests"))
from conftest import fs_type  # noqa: E402
env["work_fs"] = fs_type(work)
from fp_core import _native  # noqa: E402
probe = os.path.join(work, ".engine-probe")
eng = _native.Engine(probe, create=True)
env["engine"] = f"{eng.backend}, alignment {eng.alignment}, memory alignment {eng.mem_alignment}" + \
    (f" ({eng.backend_reason})" if eng.backend_reason else "")
eng.close()
os.unlink(probe)
with open(os.environ["FP_ENV_JSON"], "w") as f:
    json.dump(env, f, indent=1)
for k, v in env.items():
    print(f"{k}: {v}")
if missing:
    print("missing: " + "; ".join(missing))
EOF
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pcie.link.gen.current,pcie.link.width.current \
            --format=csv 2>&1 | head -5
    fi
    exit 0
fi

# ------------------------------------------------------------------ main
BUDGET=${FP_GPU_CHECK_BUDGET_S:-480}
T0=$(date +%s.%N)
if [ -n "${OUT:-}" ]; then
    LOGS=$OUT
    mkdir -p "$LOGS"
else
    LOGS=$(mktemp -d "${TMPDIR:-/tmp}/fp-gpu-check.XXXXXX")
fi
WORK=${FP_GPU_CHECK_DIR:-$REPO/.test-tmp/gpu-check}  # on the repository's disk (not tmpfs: O_DIRECT)
rm -rf "$WORK"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
export FP_WORK=$WORK FP_ENV_JSON=$LOGS/env.json FP_EXAMPLE_TMP=$WORK
PHASES=$LOGS/phases.tsv
: >"$PHASES"

# Adam is torch's default, the common case: its step counters stay on the CPU beside the
# CUDA moments, so the checkpoint mixes CPU storages among device ones (writer._batches
# cuts such a layout on block boundaries: tests/core/test_cuda_logic.py, and on the GPU
# tests/core/test_cuda.py::test_overlap_with_device_batches_and_cpu_step_tensors).
# FP_GPU_ASYNC_ADAM=fused keeps every storage on the GPU.
# Sizes. The async checkpoint is 3 copies (weights, exp_avg, exp_avg_sq) of 14 layers of
# 8192 x 8192 (+ bias) float32: 939.6M params, 11.28 GB, one 256 MiB storage per matrix. Each
# mode runs 1 warm-up + 2 measured iterations of ~1 s (calibrated) between two baseline
# runs: 7 baseline runs (~21 s), and 18 saves of 11.3 GB: at 4-6 GB/s for fp_core and ~1-2
# GB/s for torch.save (its CRC-32 and buffered writes) that is ~30 s for the three
# AsyncCheckpointer rows and ~30-40 s for each of torch.save, Lightning and DCP, plus
# calibration and start-up (~20 s): about 3 minutes. No write probe (bench-sync measures
# the writes alone). GPU memory: 15 GB of model, gradients and Adam state, ~10 GB of
# activations, up to 3 x 11.3 GB of Lightning's queued clones; host: a pinned 16 GiB arena
# (11.3 GB rounded up to a power of two by torch's pinned allocator).
# The sync bench: 4 GiB state dict on the GPU, 1 warm-up + 2 rounds of the device, torch.save
# and fp_core.save rows and their loads: ~60 s at those speeds.
ASYNC_ARGS=(bench --async --device cuda --dtype "${FP_GPU_ASYNC_DTYPE:-float32}" --adam "${FP_GPU_ASYNC_ADAM:-default}"
    --width "${FP_GPU_ASYNC_WIDTH:-8192}" --layers "${FP_GPU_ASYNC_LAYERS:-14}"
    --compute-ms "${FP_GPU_ASYNC_COMPUTE_MS:-1000}" --iters "${FP_GPU_ASYNC_ITERS:-2}" --warmup 1 --rounds 1
    --modes none,auto,overlap,snapshot,process,torch,lightning,dcp --no-write-probe --dir "$WORK/async")
SYNC_ARGS=(bench --device cuda --size "${FP_GPU_SYNC_SIZE:-4GiB}" --repeat 2 --warmup-rounds 1
    --only device,torch,fastpersist,load_device,load_torch,load_fastpersist,load_fastpersist_verify
    --dir "$WORK/sync")
PYTEST_ARGS=(-m pytest -p no:cacheprovider --basetemp "$WORK/pytest")

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v t0="$T0" -v b="$BUDGET" -v n="$(now)" 'BEGIN { printf "%d", b - (n - t0) }'; }

# phase NAME MAX_S MIN_S COMMAND...: run under timeout min(MAX_S, what is left - 5 s); record it
phase() {
    local name=$1 max=$2 min=$3
    shift 3
    local log="$LOGS/phase-$name.log" t rc status start secs cmd
    cmd=$(printf '%s ' "$@" | tr '\t\n' '  ' | tr -s ' ')  # one TSV field
    t=$(($(left) - 5))
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt "$min" ]; then
        printf '%s\tskipped\t-\t0\t%s\t%s\t%s\n' "$name" "$t" "$(basename "$log")" "$cmd" >>"$PHASES"
        echo "== $name: skipped (${t} s left in the time box, it needs ${min} s)"
        return 0
    fi
    echo "== $name (timeout ${t} s): $cmd"
    start=$(now)
    timeout -k 10 "$t" "$@" >"$log" 2>&1 </dev/null
    rc=$?
    secs=$(elapsed "$start")
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$t" "$(basename "$log")" "$cmd" >>"$PHASES"
    echo "   $status (exit $rc) in $secs s"
    return 0
}

phase setup 90 20 bash "$SELF" __setup
HAS_GPU=0
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
    HAS_GPU=1
fi

if [ "$HAS_GPU" = 1 ]; then
    # -v: a test that hangs past the phase's timeout still leaves the names of those that passed
    phase cuda-tests 200 30 "$PY" "${PYTEST_ARGS[@]}" -m cuda -v -rfEsxX --durations=10 tests/core/test_cuda.py tests/core/test_process_writer_cuda.py tests/integrations/test_sharded_cuda.py tests/integrations/test_lightning_fsdp_cuda.py
    phase bench-async 200 60 "$PY" -m fp_core.tools.cli "${ASYNC_ARGS[@]}" --json-out "$LOGS/bench-async.json"
    phase bench-sync 90 30 "$PY" -m fp_core.tools.cli "${SYNC_ARGS[@]}" --json-out "$LOGS/bench-sync.json"
    phase lightning 75 30 "$PY" examples/lightning_finetune.py --large --accelerator gpu --steps 4 --dir "$WORK/lightning"
    phase hf 75 30 "$PY" examples/hf_finetune.py --large --device cuda --steps 4 --save-steps 2 --dir "$WORK/hf"
else
    echo "== no CUDA device here (torch.cuda.is_available() is False): checking that the GPU run would start"
    phase dry-imports 60 10 "$PY" -c "import fp_core, fp_core.tools.cli, fp_core.tools.bench, fp_core.tools.bench_async, fp_core._native, \
fp_integrations.lightning, fp_integrations.hf, lightning, transformers, accelerate, safetensors, pytest, fsspec, numpy; \
print('imports ok')"
    phase dry-collect 90 10 bash -c '"$0" "$@" | tee /dev/stderr | grep -Eq "^[0-9]+ tests? collected"' \
        "$PY" "${PYTEST_ARGS[@]}" -m cuda --collect-only -q tests/core/test_cuda.py tests/core/test_process_writer_cuda.py tests/integrations/test_sharded_cuda.py tests/integrations/test_lightning_fsdp_cuda.py
    phase dry-bench-async 60 10 "$PY" -m fp_core.tools.cli "${ASYNC_ARGS[@]}" --dry-run
    phase dry-bench-sync 60 10 "$PY" -m fp_core.tools.cli "${SYNC_ARGS[@]}" --dry-run
    phase dry-examples 90 10 bash -c '"$0" examples/lightning_finetune.py --help | grep -q -- --accelerator &&
        "$0" examples/hf_finetune.py --help | grep -q -- "--device" && echo "example options ok"' "$PY"
fi

# ------------------------------------------------------------------ summary
TOTAL=$(elapsed "$T0")
export FP_LOGS=$LOGS FP_PHASES=$PHASES FP_TOTAL=$TOTAL FP_BUDGET=$BUDGET FP_HAS_GPU=$HAS_GPU
"$PY" - <<'EOF' >"$LOGS/gpu-check.txt" 2>&1
import json, os, socket, time
logs, total = os.environ["FP_LOGS"], float(os.environ["FP_TOTAL"])
phases = []
with open(os.environ["FP_PHASES"]) as f:
    for line in f:
        name, status, rc, secs, timeout, log, cmd = line.rstrip("\n").split("\t", 6)
        phases.append({"phase": name, "status": status, "exit": None if rc == "-" else int(rc),
                       "seconds": float(secs), "timeout_s": int(timeout), "log": log, "command": cmd})
env = {}
if os.path.exists(os.path.join(logs, "env.json")):
    with open(os.path.join(logs, "env.json")) as f:
        env = json.load(f)
gpu = os.environ["FP_HAS_GPU"] == "1"
res = {"host": socket.gethostname(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": gpu,
       "budget_s": int(os.environ["FP_BUDGET"]), "total_s": total, "env": env, "phases": phases,
       "passed": all(p["status"] in ("ok", "skipped") for p in phases)}
for key in ("bench-async", "bench-sync"):
    p = os.path.join(logs, f"{key}.json")
    if os.path.exists(p):
        with open(p) as f:
            res[key] = json.load(f)
with open(os.path.join(logs, "gpu-check.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)

print(f"FastPersist GPU check (issue #16) on {res['host']}, {res['date']}: {total:.0f} s of a {res['budget_s']} s box")
print(f"device: {env.get('gpu') or 'no CUDA device: dry checks only, the GPU phases did not run'}")
print(f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), lightning {env.get('lightning')}, transformers "
      f"{env.get('transformers')}; {env.get('cpus')} CPUs, {env.get('ram_gib')} GiB RAM; work dir on "
      f"{env.get('work_fs')} ({env.get('work_free_gib')} GiB free), engine {env.get('engine')}")
print()
print(f"{'phase':16s} {'status':8s} {'exit':>4s} {'seconds':>8s} {'timeout':>8s}  log")
for p in phases:
    print(f"{p['phase']:16s} {p['status']:8s} {'-' if p['exit'] is None else p['exit']:>4} {p['seconds']:8.1f} "
          f"{p['timeout_s']:8d}  {p['log']}")
print(f"\n{'PASSED' if res['passed'] else 'FAILED'}" + ("" if gpu else " (no GPU: dry checks)"))
tails = {"bench-async": 40, "bench-sync": 30, "cuda-tests": 40}
for p in phases:
    path = os.path.join(logs, p["log"])
    if p["status"] == "skipped" or not os.path.exists(path):
        continue
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    n = tails.get(p["phase"], 15)
    print(f"\n--- {p['phase']} ({p['status']}), last {min(n, len(lines))} of {len(lines)} lines of {p['log']}:")
    for line in lines[-n:]:
        print("  " + line[:220])
EOF
SUMMARY_RC=$?
cat "$LOGS/gpu-check.txt"
if [ "$SUMMARY_RC" != 0 ]; then
    echo "(the summary script failed; the phases were:)"
    cat "$PHASES"
fi
[ -n "${OUT:-}" ] || echo "(logs in $LOGS)"
if awk -F'\t' '$2 == "failed" || $2 == "timeout" { bad = 1 } END { exit bad ? 0 : 1 }' "$PHASES"; then
    exit 1
fi
exit 0
