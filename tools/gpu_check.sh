#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, run what the CPU-only CI cannot, and write one report.
#
#   1. the CUDA tests: every test of tests/ whose name says cuda (the `device` fixture's [cuda]
#      parameter, the *OnCUDA classes), tests/test_triton.py and the browser tests left out;
#   2. the Triton kernel compiled for the GPU: tests/test_triton.py (against GATHER and SDPA), then
#      bench/bench_triton.py's CUDA rows (checked against SDPA, then timed against it);
#   3. bench/ on CUDA: the CUDA benches first (attention, slot_mapping), then every other
#      bench/bench_*.py module while the stage's time lasts, one process each.
#
# Each stage runs under its own time limit (defaults: 150 + 150 + 170 s, under 8 minutes with the
# start-up). The report (Markdown) goes to --output, by default bench/GPU_RESULTS.md: nvidia-smi,
# Python, torch, Triton and CUDA versions, each stage's pass/fail counts and time, each bench's rows
# and ratios. The exit status is 0 when every stage passed, 1 when one failed or timed out.
#
# Where there is no CUDA device (CUDA_VISIBLE_DEVICES= hides one) the script says "no CUDA device" and
# exits 0 in seconds, without touching bench/GPU_RESULTS.md (the report goes to --output when one is
# given, else to stdout).
# --dry-run detects the machine and prints the plan, running no stage. --force runs the stages on a
# machine without a GPU too (to try the script itself: the CUDA tests all skip there, so stage 1
# reports no test run); --quick gives the benches their tiny sizes (run_all.py --quick).
#
# Which Python: --python PY if given; else .venv/bin/python (made with `make venv` from a fresh
# clone when a GPU is visible and .venv is missing) if its torch sees the GPU; else python3 on
# PATH if its torch does (the device image's own torch). constraints.txt pins torch 2.13.0, which
# pip installs as a CUDA build from PyPI on Linux; on a machine without a network `make venv`
# fails, the script says so in the report and uses the torch that is there, with the package on
# PYTHONPATH. Test files that import a package this Python lacks (fastapi, say) are reported as
# not collected, not as failures.
#
#   tools/gpu_check.sh [--output PATH] [--python PY] [--dry-run] [--force] [--quick] [--no-venv]
#                      [--cuda-benches-only]
#                      [--tests-timeout S] [--triton-timeout S] [--bench-timeout S] [--workers N]
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

OUTPUT=""
PYTHON_GIVEN=""
DRY_RUN=0
FORCE=0
QUICK=()
MAKE_VENV=1
CUDA_BENCHES_ONLY=0
TESTS_TIMEOUT=150
TRITON_TIMEOUT=150
BENCH_TIMEOUT=170
WORKERS=""
CUDA_BENCHES=(attention slot_mapping)   # bench_triton runs in stage 2
LAST_BENCHES=(hf)                       # the slowest, run last

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --output) OUTPUT="$2"; shift 2 ;;
        --output=*) OUTPUT="${1#*=}"; shift ;;
        --python) PYTHON_GIVEN="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --force) FORCE=1; shift ;;
        --quick) QUICK=(--quick); shift ;;
        --no-venv) MAKE_VENV=0; shift ;;
        --cuda-benches-only) CUDA_BENCHES_ONLY=1; shift ;;
        --tests-timeout) TESTS_TIMEOUT="$2"; shift 2 ;;
        --triton-timeout) TRITON_TIMEOUT="$2"; shift 2 ;;
        --bench-timeout) BENCH_TIMEOUT="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
REPORT="$WORK/report.md"
NOTES="$WORK/notes.md"   # what the set-up found, as Markdown list items
: >"$NOTES"
START=$(date +%s)

say() { echo "== gpu_check: $*" >&2; }
note() { echo "- $*" >>"$NOTES"; say "$*"; }
elapsed() { echo $(( $(date +%s) - START )); }

# ------------------------------------------------------------------------------ the machine

SMI="no nvidia-smi on this machine"
GPU_VISIBLE=0
if command -v nvidia-smi >/dev/null 2>&1; then
    SMI="$(timeout 20 nvidia-smi 2>&1)" || SMI="nvidia-smi failed: $SMI"
    if timeout 20 nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then GPU_VISIBLE=1; fi
fi
if compgen -G '/dev/nvidia[0-9]*' >/dev/null; then GPU_VISIBLE=1; fi
# CUDA_VISIBLE_DEVICES= (empty) or -1 hides every GPU from torch: then there is none to check
if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ] || [ "${CUDA_VISIBLE_DEVICES-}" = "-1" ]; then
    GPU_VISIBLE=0; SMI="$SMI
(CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' hides every GPU from torch)"
fi

# probe PY: one line "torch=... cuda=... available=0|1 device=... capability=... triton=... xdist=0|1"
probe() {
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout 120 "$1" - <<'EOF' 2>/dev/null
import importlib.util
try:
    import torch
except Exception as error:  # noqa: BLE001
    print(f"torch=none ({type(error).__name__}) cuda=none available=0")
    raise SystemExit
available = torch.cuda.is_available()
fields = {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "available": int(available)}
if available:
    fields["device"] = torch.cuda.get_device_name(0).replace(" ", "_")
    fields["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(0)
try:
    import triton
    fields["triton"] = triton.__version__
except Exception:  # noqa: BLE001
    fields["triton"] = "none"
fields["xdist"] = int(importlib.util.find_spec("xdist") is not None)
fields["pytest"] = int(importlib.util.find_spec("pytest") is not None and importlib.util.find_spec("hypothesis") is not None)
print(" ".join(f"{key}={value}" for key, value in fields.items()))
EOF
}
# light_probe PY: the same fields, read from the installed packages' metadata (torch not imported)
light_probe() {
    timeout 30 "$1" - <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import importlib.util


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


xdist = int(importlib.util.find_spec("xdist") is not None)
print(f"torch={version('torch')} cuda=unknown available=0 triton={version('triton')} xdist={xdist}")
EOF
}
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$2"; }

PYTHON=""
INFO=""
FALLBACK=""  # the first Python with a torch, for --force
try_python() {  # try_python PY WHY: take PY if its torch sees a CUDA device
    local info
    command -v "$1" >/dev/null 2>&1 || [ -x "$1" ] || { note "$2: $1 not found"; return 1; }
    info="$(probe "$1")"
    if [ "$(field available "$info")" = 1 ]; then
        PYTHON="$1"; INFO="$info"
        note "$2: $1 (torch $(field torch "$info"), CUDA $(field cuda "$info")) sees $(field device "$info" | tr _ ' ')"
        return 0
    fi
    case "$info" in
        "torch=none"*|"") note "$2: $1 has no torch" ;;
        *) note "$2: $1 has torch $(field torch "$info") (CUDA $(field cuda "$info")), which sees no CUDA device"
           [ -n "$INFO" ] || { INFO="$info"; FALLBACK="$1"; } ;;
    esac
    return 1
}

if [ -n "$PYTHON_GIVEN" ]; then
    try_python "$PYTHON_GIVEN" "--python"
else
    if [ ! -f .venv/.installed ] && [ "$GPU_VISIBLE" = 1 ] && [ "$MAKE_VENV" = 1 ] && [ "$DRY_RUN" = 0 ]; then
        had_venv=0; [ -e .venv ] && had_venv=1
        say "no .venv: make venv (pip install --constraint constraints.txt), at most 300 s"
        if PIP_RETRIES=0 PIP_DEFAULT_TIMEOUT=10 timeout 300 make venv >"$WORK/venv.log" 2>&1; then
            note "make venv: installed .venv from constraints.txt in $(elapsed) s"
        else
            note "make venv failed (no network, or no CUDA build of the pinned torch to be had), so the torch already on this machine is used: $(grep -E 'ERROR|Error|error' "$WORK/venv.log" | tail -1 | cut -c1-200)"
            [ "$had_venv" = 1 ] || rm -rf .venv
        fi
    fi
    if [ "$GPU_VISIBLE" = 0 ] && [ "$FORCE" = 0 ]; then
        # no GPU to find: name the versions without importing torch (seconds on a busy machine)
        for candidate in .venv/bin/python python3; do
            command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
            INFO="$(light_probe "$candidate")"
            [ -n "$INFO" ] && { FALLBACK="$candidate"; break; }
        done
        note "no GPU visible (nvidia-smi lists none, no /dev/nvidia0, or CUDA_VISIBLE_DEVICES hides it)${FALLBACK:+; $FALLBACK has torch $(field torch "$INFO")}"
    else
        if [ -x .venv/bin/python ]; then try_python .venv/bin/python ".venv"; fi
        [ -n "$PYTHON" ] || try_python python3 "python3 on PATH" || true
    fi
fi

GIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
NOW="$(date -u '+%Y-%m-%d %H:%M UTC')"

header() {  # header RESULT
    cat <<EOF
# GPU check

Generated by \`tools/gpu_check.sh\` on $NOW at commit $GIT: **$1**.
What each bench row measures: [README.md](README.md); the CPU figures: [RESULTS.md](RESULTS.md).

## Machine

- GPU: $(if [ "$(field available "$INFO")" = 1 ]; then field device "$INFO" | tr _ ' '; echo " ($(field capability "$INFO"))"; else echo "no CUDA device"; fi)
- Python: ${PYTHON:-none with a CUDA torch} $( [ -n "$PYTHON" ] && "$PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null)
- torch: $(field torch "${INFO:-torch=none}"), CUDA $(field cuda "${INFO:-cuda=none}")
- triton: $(field triton "${INFO:-triton=none}")
- CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //'), $(nproc) cores
$(cat "$NOTES")

\`\`\`text
$ nvidia-smi
$SMI
\`\`\`
EOF
}

if [ -z "$PYTHON" ] && [ "$FORCE" = 1 ] && [ -n "$FALLBACK" ]; then
    PYTHON="$FALLBACK"
    note "--force: the stages run on the CPU with $PYTHON: the CUDA tests skip, the numbers mean nothing"
elif [ -z "$PYTHON" ] && [ "$DRY_RUN" = 1 ]; then
    PYTHON="${FALLBACK:-python3}"
    note "no CUDA device: the plan below is what a machine with one would run"
elif [ -z "$PYTHON" ]; then
    if [ "$GPU_VISIBLE" = 1 ]; then
        header "FAIL: nvidia-smi lists a GPU, but no Python here has a torch that sees it" >"$REPORT"
        RC=1
    else
        header "no CUDA device: nothing to check on this machine" >"$REPORT"
        RC=0
    fi
    say "no CUDA device: no stage run ($(elapsed) s)"
    if [ -n "$OUTPUT" ]; then cp "$REPORT" "$OUTPUT" && say "wrote $OUTPUT"; else cat "$REPORT"; fi
    exit "$RC"
fi

# ------------------------------------------------------------------------------ the stages

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=dev
unset TRITON_INTERPRET   # Triton compiles for the GPU (tests/conftest.py sets it only without CUDA)
[ "$(field available "$INFO")" = 1 ] || export TRITON_INTERPRET=1   # --force on a CPU
OUTPUT="${OUTPUT:-$ROOT/bench/GPU_RESULTS.md}"

if [ -z "$WORKERS" ]; then
    WORKERS=$(nproc); [ "$WORKERS" -gt 8 ] && WORKERS=8
fi
PARALLEL=()
if [ "$(field xdist "$INFO")" = 1 ] && [ "$WORKERS" -gt 1 ]; then PARALLEL=(-n "$WORKERS"); fi
# -p no:nbval: the stages run no notebook, and a broken nbval (or its nbformat missing) stops pytest
PYTEST=("$PYTHON" -m pytest -p no:cacheprovider -p no:nbval -q -rfE --continue-on-collection-errors "${PARALLEL[@]}")
STAGE1=("${PYTEST[@]}" tests --ignore=tests/browser --ignore=tests/test_triton.py -k cuda)
STAGE2=("${PYTEST[@]}" tests/test_triton.py)
mapfile -t ALL_BENCHES < <(cd bench && ls bench_*.py | sed 's/^bench_//; s/\.py$//')
BENCHES=("${CUDA_BENCHES[@]}")
if [ "$CUDA_BENCHES_ONLY" = 0 ]; then
    for name in "${ALL_BENCHES[@]}"; do
        case " ${CUDA_BENCHES[*]} triton ${LAST_BENCHES[*]} " in *" $name "*) ;; *) BENCHES+=("$name") ;; esac
    done
    BENCHES+=("${LAST_BENCHES[@]}")
fi

if [ "$DRY_RUN" = 1 ]; then
    {
        header "dry run: the plan, nothing run$([ "$(field available "$INFO")" = 1 ] || echo '; no CUDA device')"
        echo
        echo "## Plan"
        echo
        echo "1. CUDA tests (at most $TESTS_TIMEOUT s): \`${STAGE1[*]}\`"
        echo "2. Triton kernel (at most $TRITON_TIMEOUT s): \`${STAGE2[*]}\`, then \`$PYTHON bench/run_all.py --only triton ${QUICK[*]}\`"
        echo "3. benches (at most $BENCH_TIMEOUT s in all), one \`bench/run_all.py --only NAME\` each: ${BENCHES[*]}"
    } >"$REPORT"
    cat "$REPORT"
    exit 0
fi

SUMMARY="$WORK/summary.md"   # one table row per stage
SECTIONS="$WORK/sections.md"
: >"$SUMMARY"; : >"$SECTIONS"
FAILED=0

counts() {  # counts LOG: "passed failed skipped errors" from pytest's last summary line
    local line
    line="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$1" | tail -1)"
    for word in passed failed skipped error; do
        local n
        n="$(grep -oE "[0-9]+ ${word}s?" <<<"$line" | grep -oE '[0-9]+' | head -1)"
        printf '%s ' "${n:-0}"
    done
}

run_pytest_stage() {  # run_pytest_stage NUMBER TITLE LIMIT CMD...
    local number="$1" title="$2" limit="$3"; shift 3
    local log="$WORK/stage$number.log" begin rc result
    say "stage $number, $title: ${*} (at most $limit s)"
    begin=$(date +%s)
    timeout -k 15 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local seconds=$(( $(date +%s) - begin ))
    read -r passed failed skipped errors <<<"$(counts "$log")"
    # a file that imports a package this Python lacks is "not collected", not a failure
    local missing
    missing="$(grep -E "^ERROR .* - (ModuleNotFoundError|ImportError)" "$log" | sort -u)"
    local missing_count; missing_count=$(grep -c . <<<"$missing")
    local real_errors=$(( errors - missing_count )); [ "$real_errors" -lt 0 ] && real_errors=0
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        result="TIMEOUT after $limit s"; FAILED=1
    elif [ "$passed" = 0 ] && [ "$failed" = 0 ]; then
        result="FAIL: no test ran"; FAILED=1
    elif [ "$failed" = 0 ] && [ "$real_errors" = 0 ] && { [ "$rc" = 0 ] || [ "$rc" = 1 ]; }; then
        result="pass"
    else
        result="FAIL (exit $rc)"; FAILED=1
    fi
    echo "| $number. $title | $result | $passed | $failed | $skipped | $real_errors | $missing_count | $seconds s of $limit |" >>"$SUMMARY"
    {
        echo; echo "## $number. $title: $result"; echo
        echo "\`${*}\`, $seconds s: $passed passed, $failed failed, $skipped skipped, $real_errors errors, $missing_count files not collected."
        if [ -n "$missing" ]; then
            echo; echo "Not collected (a package this Python lacks):"; echo
            awk '/ERROR collecting / { match($0, /ERROR collecting [^ ]+/); file = substr($0, RSTART + 17, RLENGTH - 17) }
                 /^E .*No module named / && file != "" { match($0, /No module named [^ ]+/); print "- " file ": " substr($0, RSTART, RLENGTH); file = "" }' \
                "$log" | sort -u
        fi
        local problems
        problems="$(grep -E '^(FAILED|ERROR) ' "$log" | grep -vE ' - (ModuleNotFoundError|ImportError)' | head -40)"
        if [ -n "$problems" ]; then echo; echo '```text'; echo "$problems"; echo '```'; fi
        if [ "$result" != pass ]; then echo; echo "The log's last lines:"; echo; echo '```text'; tail -25 "$log"; echo; echo '```'; fi
    } >>"$SECTIONS"
    say "stage $number: $result, $passed passed, $failed failed, $skipped skipped, $real_errors errors ($seconds s)"
}

BENCH_TABLES="$WORK/bench_tables.md"
: >"$BENCH_TABLES"
run_bench() {  # run_bench NAME LIMIT: one bench module through run_all.py; appends its table
    local name="$1" limit="$2" log="$WORK/bench_$1.log" md="$WORK/bench_$1.md" begin rc
    begin=$(date +%s)
    timeout -k 10 "$limit" "$PYTHON" bench/run_all.py --only "$name" "${QUICK[@]}" --output "$md" >"$log" 2>&1
    rc=$?
    local seconds=$(( $(date +%s) - begin ))
    if [ "$rc" = 0 ] && [ -s "$md" ]; then
        # run_all's own file: keep its "## bench_NAME (s)" section, one heading level down
        sed -n '/^## bench_/,$p' "$md" | sed 's/^## /### /' >>"$BENCH_TABLES"
        grep -E '^bench_|skipped|no row' "$log" | sed 's/^/> /' >>"$BENCH_TABLES"
        echo >>"$BENCH_TABLES"
        echo "ran"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        printf '### bench_%s: stopped after %s s (the stage'"'"'s time ran out)\n\n' "$name" "$limit" >>"$BENCH_TABLES"
        echo "timeout"
    else
        local why
        why="$(grep -E 'Error|error' "$log" | tail -1 | cut -c1-200)"
        printf '### bench_%s: did not run (exit %s, %s s)\n\n```text\n%s\n```\n\n' "$name" "$rc" "$seconds" "$why" >>"$BENCH_TABLES"
        if grep -qE 'ModuleNotFoundError|ImportError' "$log"; then echo "missing"; else echo "failed"; fi
    fi
}

# 1. the CUDA tests
run_pytest_stage 1 "CUDA tests" "$TESTS_TIMEOUT" "${STAGE1[@]}"

# 2. the compiled Triton kernel: its tests, then bench_triton against SDPA
stage_begin=$(date +%s)
run_pytest_stage 2 "Triton kernel compiled, against GATHER and SDPA" "$TRITON_TIMEOUT" "${STAGE2[@]}"
left=$(( TRITON_TIMEOUT - ($(date +%s) - stage_begin) )); [ "$left" -lt 30 ] && left=30
triton_bench="$(run_bench triton "$left")"
[ "$triton_bench" = ran ] || FAILED=1
echo "| 2. bench_triton (kernel vs SDPA, timed) | $triton_bench | | | | | | $left s left |" >>"$SUMMARY"

# 3. the benches, CUDA ones first, while the stage's time lasts
stage_begin=$(date +%s)
declare -A BENCH_RESULT=()
for name in "${BENCHES[@]}"; do
    left=$(( BENCH_TIMEOUT - ($(date +%s) - stage_begin) ))
    if [ "$left" -lt 5 ]; then BENCH_RESULT[$name]="not started (stage time spent)"; continue; fi
    say "stage 3: bench_$name (at most $left s)"
    BENCH_RESULT[$name]="$(run_bench "$name" "$left")"
    case " ${CUDA_BENCHES[*]} " in *" $name "*) [ "${BENCH_RESULT[$name]}" = ran ] || FAILED=1 ;; esac
done
bench_seconds=$(( $(date +%s) - stage_begin ))
ran=0; for name in "${BENCHES[@]}"; do [ "${BENCH_RESULT[$name]}" = ran ] && ran=$((ran + 1)); done
echo "| 3. benches | $ran of ${#BENCHES[@]} ran | | | | | | $bench_seconds s of $BENCH_TIMEOUT |" >>"$SUMMARY"

RESULT="all stages passed"; [ "$FAILED" = 0 ] || RESULT="FAIL: a stage failed or ran out of time"
{
    header "$RESULT, $(elapsed) s in all"
    echo
    echo "## Stages"
    echo
    echo "| stage | result | passed | failed | skipped | errors | files not collected | time |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|"
    cat "$SUMMARY"
    cat "$SECTIONS"
    echo
    echo "## 3. Benchmarks on CUDA"
    echo
    echo "Each ratio compares the package with a baseline timed in the same run (bench/README.md)."
    echo "Per module: $(for name in "${BENCHES[@]}"; do printf 'bench_%s %s; ' "$name" "${BENCH_RESULT[$name]}"; done)"
    echo
    cat "$BENCH_TABLES"
} >"$REPORT"
cp "$REPORT" "$OUTPUT"
say "$RESULT; wrote $OUTPUT ($(elapsed) s)"
exit "$FAILED"
