#!/usr/bin/env bash
# GPU check for a runner with torch preinstalled and no uv, nox or package index:
#   1. every packages/*/src on PYTHONPATH (nothing is installed into the interpreter), the dev-only
#      test harness packages/testing/src (automodel.testing) among them;
#   2. wheels found in .whl/ (e.g. megatron-fsdp, liger-kernel, torchao: pure Python) installed into a temporary
#      directory with `pip install --no-index --no-deps --target` and prepended to PYTHONPATH;
#   3. the environment printed (python, torch, CUDA, GPUs, transformers, megatron-fsdp, ...);
#   4. `python -m pytest -m gpu -p no:cacheprovider -rs` over the repository's test paths;
#   5. benchmarks/gpu_throughput.py, short settings: plain torch vs ours in one run (tokens/s, MFU);
#   6. benchmarks/recipes_gpu_1b.py: `recipes train` at the Llama-3.2-1B shape, seq 4096, compiled,
#      fp32 master weights and all-bf16 (tokens/s, MFU, peak memory); `--recipes-args "--variants
#      bf16,bf16-liger,bf16-fp8"` adds Liger's kernels / FP8 (liger-kernel, torchao wheels in .whl/);
#   7. NeMo AutoModel 0.7.0's one-GPU default on the same shape, where its peer folder (with the
#      wheels its get_wheels.sh downloads in whl/) is present: .peers/automodel in the checkout, else
#      ../shared/peers/automodel beside it;
#   8. ONE summary block: each gpu test's pass/fail/skip (with the reason), the benchmarks' MFU,
#      memory and ratio lines, ours vs AutoModel, and the verdict.
# About 8 minutes on one H100/H200 (each step prints its wall time).
# Exit status: 0 when pytest passed (skips allowed) and the benchmark ran or could not run for
# lack of CUDA; 1 when pytest failed or the benchmark failed on a machine with CUDA; 2 on bad usage.
# On a machine without CUDA it still runs: the gpu tests skip with the reason and the benchmark
# says there is no CUDA.
#
# Usage: scripts/gpu_check.sh [--python PY] [--out DIR] [--no-bench] [--bench-args "ARGS"]
#                             [--recipes-args "ARGS"] [--peer DIR | --no-peer] [-- PYTEST_ARGS...]
#   --python PY          interpreter (default: python)
#   --out DIR            keep the logs and JSON reports there (default: a temp dir, removed)
#   --no-bench           skip the benchmarks (5-7)
#   --bench-args ARGS    replaces gpu_throughput.py's default arguments (word-split)
#   --recipes-args ARGS  replaces recipes_gpu_1b.py's default arguments (word-split)
#   --peer DIR           the NeMo AutoModel peer folder (run.sh, whl/); --no-peer skips it
#   -- PYTEST_ARGS     passed to pytest after `-m gpu ...` (e.g. -- -k megatron)
# `nox -s gpu_tests` runs this script.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

PY=python
OUT=""
RUN_BENCH=1
BENCH_ARGS=""
RECIPES_ARGS=""
PEER=""
RUN_PEER=1
PYTEST_EXTRA=()
T0=$SECONDS
stamp() { echo "== [+$((SECONDS - T0)) s] $*"; }
while (($#)); do
    case "$1" in
        --python) PY="${2:?--python needs a value}"; shift 2 ;;
        --out) OUT="${2:?--out needs a value}"; shift 2 ;;
        --no-bench) RUN_BENCH=0; shift ;;
        --bench-args) BENCH_ARGS="${2?--bench-args needs a value}"; shift 2 ;;
        --recipes-args) RECIPES_ARGS="${2?--recipes-args needs a value}"; shift 2 ;;
        --peer) PEER="${2:?--peer needs a value}"; shift 2 ;;
        --no-peer) RUN_PEER=0; shift ;;
        --) shift; PYTEST_EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check.sh: interpreter '$PY' not found (pass --python PATH)" >&2
    exit 2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
if [[ -n "$OUT" ]]; then
    mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
else
    OUT="$WORK/out"
    mkdir -p "$OUT"
fi

# 1. the workspace packages' sources (packages/testing/src, the test harness, included)
SRC_PATHS=""
for src in "$ROOT"/packages/*/src; do
    SRC_PATHS="${SRC_PATHS:+$SRC_PATHS:}$src"
done

# 2. wheels brought along in .whl/
WHEEL_NOTE="no .whl/ folder"
WHEEL_DIR=""
shopt -s nullglob
WHEELS=("$ROOT"/.whl/*.whl)
shopt -u nullglob
if ((${#WHEELS[@]})); then
    WHEEL_DIR="$WORK/wheels"
    echo "== installing ${#WHEELS[@]} wheel(s) from .whl/ into $WHEEL_DIR"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        if PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check --no-index \
            --no-deps --target "$WHEEL_DIR" "${WHEELS[@]}"; then
            WHEEL_NOTE="installed with pip: $(basename -a "${WHEELS[@]}" | tr '\n' ' ')"
        else
            WHEEL_NOTE="pip install of .whl/*.whl FAILED (see above); continuing without them"
            WHEEL_DIR=""
        fi
    else
        # No pip in this interpreter: a wheel is a zip; unpacking it is enough for pure-Python wheels.
        if "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$WHEEL_DIR" "${WHEELS[@]}"; then
            WHEEL_NOTE="no pip here: unpacked (pure-Python wheels only): $(basename -a "${WHEELS[@]}" | tr '\n' ' ')"
        else
            WHEEL_NOTE="unpacking .whl/*.whl FAILED (see above); continuing without them"
            WHEEL_DIR=""
        fi
    fi
fi
export PYTHONPATH="${WHEEL_DIR:+$WHEEL_DIR:}$SRC_PATHS${PYTHONPATH:+:$PYTHONPATH}"

# 3. the environment (this probe is its own process: the pytest process never initialises CUDA
#    before its tests fork or launch ranks)
echo "== environment"
"$PY" - >"$OUT/env.txt" 2>&1 <<'EOF'
import importlib
import importlib.metadata as md
import platform
import sys
import warnings

warnings.filterwarnings("ignore")  # e.g. megatron-fsdp's "Transformer Engine and Apex are not installed"

def version(dist, module):
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - report, never fail the check here
        return f"missing ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return getattr(sys.modules[module], "__version__", "importable (version unknown)")


print(f"python: {platform.python_version()} ({sys.executable})")
try:
    import torch
except Exception as err:  # noqa: BLE001
    print(f"torch: missing ({err})")
    print("gpus: 0")
else:
    print(f"torch: {torch.__version__} (CUDA build {torch.version.cuda})")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        names = [torch.cuda.get_device_name(i) for i in range(count)]
        print(f"gpus: {count} x {', '.join(sorted(set(names)))}")
        print(f"cuda runtime: {torch.version.cuda}, driver sees capability {torch.cuda.get_device_capability(0)}")
        print(f"nccl: {'.'.join(map(str, torch.cuda.nccl.version()))}")
    else:
        print("gpus: 0 (torch.cuda.is_available() is False)")
for dist, module in [
    ("transformers", "transformers"),
    ("megatron-fsdp", "megatron_fsdp"),
    ("transformer-engine", "transformer_engine"),
    ("einops", "einops"),
    ("pytest", "pytest"),
    ("liger-kernel", "liger_kernel.transformers"),  # kernels.liger, the liger lever (.whl/)
    ("torchao", "torchao.float8"),  # fp8, the fp8 lever (.whl/)
]:
    print(f"{dist}: {version(dist, module)}")
print(f"automodel packages: {', '.join(sorted(p for p in sys.path if p.endswith('/src')))}")
EOF
cat "$OUT/env.txt"
echo "wheels: $WHEEL_NOTE"
GPUS="$(sed -n 's/^gpus: \([0-9]*\).*/\1/p' "$OUT/env.txt")"
GPUS="${GPUS:-0}"
ENV_LINE="$(grep -E '^(torch|gpus|transformers|megatron-fsdp|liger-kernel|torchao):' "$OUT/env.txt" | tr '\n' ';' | sed 's/;$//; s/;/; /g')"

# 4. the gpu tests
stamp "python -m pytest -m gpu -p no:cacheprovider -rs ${PYTEST_EXTRA[*]}"
"$PY" -m pytest -m gpu -p no:cacheprovider -rs --junitxml="$OUT/junit.xml" "${PYTEST_EXTRA[@]}" 2>&1 |
    tee "$OUT/pytest.log"
PYTEST_RC=${PIPESTATUS[0]}

# 5. the benchmark
BENCH_RC=""
if ((RUN_BENCH)); then
    if [[ -z "$BENCH_ARGS" ]]; then
        BENCH_ARGS="--variants plain,base,compile --steps 5 --warmup 3"
    fi
    # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
    stamp "python benchmarks/gpu_throughput.py $BENCH_ARGS"
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu_throughput.py $BENCH_ARGS --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    BENCH_RC=${PIPESTATUS[0]}
fi

# 6. recipes train at the 1B shape
RECIPES_RC=""
if ((RUN_BENCH)); then
    RECIPES_ARGS="${RECIPES_ARGS:---variants fp32-master,bf16 --steps 20 --warmup 5}"
    stamp "python benchmarks/recipes_gpu_1b.py $RECIPES_ARGS"
    # shellcheck disable=SC2086
    "$PY" benchmarks/recipes_gpu_1b.py $RECIPES_ARGS --json "$OUT/recipes_1b.json" 2>&1 | tee "$OUT/recipes_1b.log"
    RECIPES_RC=${PIPESTATUS[0]}
fi

# 7. the NeMo AutoModel peer, same shape, its one-GPU default
PEER_NOTE="not run (--no-bench or --no-peer)"
if ((RUN_BENCH && RUN_PEER && GPUS == 0)); then
    PEER_NOTE="not run: no CUDA here"
elif ((RUN_BENCH && RUN_PEER)); then
    if [[ -z "$PEER" ]]; then
        for candidate in "$ROOT/.peers/automodel" "$ROOT/../shared/peers/automodel"; do
            if compgen -G "$candidate/whl/*.whl" >/dev/null; then PEER="$candidate"; break; fi
        done
    fi
    if [[ -n "$PEER" && -f "$PEER/run.sh" ]] && compgen -G "$PEER/whl/*.whl" >/dev/null; then
        stamp "NeMo AutoModel peer: VARIANTS=native bash $PEER/run.sh"
        AM_OUT="$OUT/automodel" AM_SITE="$WORK/automodel-site" VARIANTS=native STEPS=20 WARMUP=5 BUDGET_S=240 \
            bash "$PEER/run.sh" 2>&1 | tee "$OUT/automodel.log"
        PEER_NOTE="$(grep '^SUMMARY automodel' "$OUT/automodel.log" | tail -1)"
        PEER_NOTE="${PEER_NOTE:-FAILED: no SUMMARY line (see automodel.log)}"
    else
        PEER_NOTE="not run: no peer folder with whl/ (.peers/automodel or ../shared/peers/automodel; run its get_wheels.sh)"
    fi
fi
stamp "done"

# 6. one summary block
SUMMARY="$("$PY" - "$OUT" "$PYTEST_RC" "${BENCH_RC:-none}" "$GPUS" "${RECIPES_RC:-none}" "$PEER_NOTE" <<'EOF'
import json
import os
import sys
import xml.etree.ElementTree as ET

out, pytest_rc, bench_rc, gpus = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
recipes_rc, peer_note = sys.argv[5], sys.argv[6]
lines = []
junit = os.path.join(out, "junit.xml")
if os.path.exists(junit):
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    passed = total - failed - errors - skipped
    lines.append(
        f"pytest -m gpu: {passed} passed, {failed} failed, {errors} errors, {skipped} skipped (exit {pytest_rc})"
    )
    for case in (c for s in suites for c in s.iter("testcase")):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name', '')}"
        outcome, why = "PASS", ""
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                outcome = {"skipped": "SKIP", "failure": "FAIL", "error": "ERROR"}[child.tag]
                message = (child.get("message") or "").strip()
                why = ": " + message.splitlines()[0][:160] if message else ""
        lines.append(f"  {outcome:<5} {name}{why}")
else:
    lines.append(f"pytest -m gpu: no junit report written (exit {pytest_rc}): see the pytest output above")

bench_ok = True
if bench_rc == "none":
    lines.append("benchmark: not run (--no-bench)")
else:
    bench_json = os.path.join(out, "bench.json")
    if int(bench_rc) == 0 and os.path.exists(bench_json):
        report = json.load(open(bench_json))
        lines.append(
            f"benchmark: {report['device']}, {report['shape']} seq {report['seq_len']} bs {report['batch_size']} "
            f"{report['dtype']}, median of {report['steps']} steps, MFU vs {report['peak_tflops']} TFLOP/s"
        )
        for r in report["results"]:
            lines.append(
                f"  {r['variant']:<14} {r['tokens_per_s_per_gpu']:>11.1f} tok/s/GPU  MFU {r['mfu']:7.2%}  "
                f"{r['ratio']:.3f}x {report['ratio_to']}  peak {r['peak_mem_gib']:.1f} GiB"
            )
    else:
        log = open(os.path.join(out, "bench.log")).read().strip().splitlines() if os.path.exists(
            os.path.join(out, "bench.log")) else []
        last = log[-1] if log else "(no output)"
        if gpus == 0:
            lines.append(f"benchmark: not run, no CUDA here (exit {bench_rc}): {last}")
        else:
            bench_ok = False
            lines.append(f"benchmark: FAILED (exit {bench_rc}): {last}")

recipes_json = os.path.join(out, "recipes_1b.json")
ours_bf16 = None
if recipes_rc == "none":
    lines.append("recipes train 1B: not run (--no-bench)")
elif int(recipes_rc) == 0 and os.path.exists(recipes_json):
    report = json.load(open(recipes_json))
    lines.append(
        f"recipes train: {report['device']}, {report['shape']} seq {report['seq_len']} batch 1, "
        f"median after step {report['warmup']} of {report['steps']}, MFU vs {report['peak_tflops']} TFLOP/s"
    )
    for r in report["results"]:
        lines.append(
            f"  {r['variant']:<18} {r['tokens_per_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  peak {r['peak_mem_gib']:5.1f} GiB"
        )
        if r["variant"] == "bf16":
            ours_bf16 = r["tokens_per_s"]
elif gpus == 0:
    lines.append(f"recipes train 1B: not run, no CUDA here (exit {recipes_rc})")
else:
    bench_ok = False
    lines.append(f"recipes train 1B: FAILED (exit {recipes_rc}): see recipes_1b.log")
lines.append(f"NeMo AutoModel 0.7.0 peer: {peer_note.removeprefix('SUMMARY automodel-0.7.0 ')}")
peer_tps = None
if "median tokens/s/GPU" in peer_note:
    peer_tps = float(peer_note.split("median tokens/s/GPU")[1].split()[0].replace(",", ""))
if ours_bf16 and peer_tps:
    lines.append(f"  ours all-bf16 / AutoModel native: x{ours_bf16 / peer_tps:.3f} (tokens/s, same call)")

reasons = []
if pytest_rc != 0:
    reasons.append("pytest failed" if pytest_rc != 5 else "pytest collected no gpu test")
if not bench_ok:
    reasons.append("benchmark failed on a CUDA machine")
lines.append("status: " + ("FAILED (" + "; ".join(reasons) + ")" if reasons else "OK"))
print("\n".join(lines))
sys.exit(1 if reasons else 0)
EOF
)"
STATUS=$?
echo
echo "==================== gpu_check summary ($((SECONDS - T0)) s) ===================="
echo "environment: $ENV_LINE"
echo "wheels: $WHEEL_NOTE"
echo "$SUMMARY"
if [[ "$OUT" != "$WORK/out" ]]; then
    echo "logs: $OUT (env.txt, pytest.log, junit.xml, bench.log, bench.json, recipes_1b.*, automodel.log)"
fi
echo "==========================================================="
exit "$STATUS"
