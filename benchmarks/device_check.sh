#!/usr/bin/env bash
# One call on a GPU host: the whole gpu suite, the softmax bench next to PyTorch, and (CHECK_SERVE=1) a served
# tuning job over REST. Logs go to $OUT (or ./out); the last lines printed are a summary a file each.
#
# The verification files run under pytest-xdist where it is importable (NW workers, 8 by default). Each
# worker is its own process and CUDA context, so a kernel that faults takes down one worker, which xdist
# replaces, and the compiles spread over the host's cores: the whole suite took about 7 minutes on an H100
# host of 16 cores, where one process had run 67 of its 216 tests in 520 s (9 minutes for 628 tests on an
# H200 host of 16 cores, 2026-11-28). The files that start services,
# subprocesses or Nsight run after them, one process each.
#
# PART=verify runs only the verification files, PART=rest the rest (the serial files, the bench and
# CHECK_SERVE): together close to 10 minutes, so where one call may not run that long, make it two.
set -u
part=${PART:-all}
case "$part" in
  all | verify | rest) ;;
  *)
    echo "device_check.sh: PART must be all, verify or rest (got '$part')" >&2
    exit 2
    ;;
esac
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Every GPU test runs here, or the run fails: a broken pycuda or driver must not pass as "N skipped".
export KERNELMILL_REQUIRE_GPU=1
# And what the GPU tests importorskip: CUDA graphs need cuda.bindings, the baselines torch.
export KERNELMILL_REQUIRE_MODULES=torch,cuda.bindings,pycuda
# pytest puts the rootdir on sys.path, where the source folder kernelmill/ would shadow the installed
# package (whose subpackages live in other folders): run the tests from a copy, one of this run's own.
kmtests=$(mktemp -d "${TMPDIR:-/tmp}/kmtests.XXXXXX")
serve_pid=""
cleanup() {
  if [ -n "$serve_pid" ]; then # CHECK_SERVE's service: stopped with the script, not left holding port 8000
    kill "$serve_pid" 2> /dev/null
    wait "$serve_pid" 2> /dev/null
  fi
  rm -rf "$kmtests"
}
trap cleanup EXIT
cp -r tests pyproject.toml "$kmtests/"
py="python3"
# `python3 -m kernelmill`, not the console script: pip install --target into a folder that already has a bin/
# (another wheel's scripts) leaves the script out with only a warning. Run from /tmp, where no source folder
# shadows the installed package.
km() { (cd /tmp && "$py" -m kernelmill "$@"); }
# What docs/PERFORMANCE.md asks of every figure: the device, the date and the command, kept with the logs.
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "command: PART=$part NW=${NW:-8} CHECK_SERVE=${CHECK_SERVE:-0} bash benchmarks/device_check.sh"
  echo "commit: $(git rev-parse --short HEAD 2> /dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
} | tee "$OUT/run.txt"
parallel=(tests/gpu/test_families_gpu.py tests/gpu/test_wgmma_gpu.py tests/gpu/test_softmax_gpu.py
  tests/gpu/test_mlp_stack_gpu.py tests/gpu/test_runtime_gpu.py tests/gpu/test_runtime_check_gpu.py
  tests/gpu/test_bench_gpu.py)
serial=(test_faults_gpu test_profile_gpu test_profile_forward_gpu test_service_gpu test_multi_gpu)
xdist=()
$py -c "import xdist" 2> /dev/null && xdist=(-n "${NW:-8}")
summary=("run: $OUT/run.txt (date, command, device)")
# A pytest run that fails (a test failed, or the session refused to start: KERNELMILL_REQUIRE_GPU on a host
# without a working GPU) fails the script; its summary line is the log's last non-empty one (pytest's
# totals, or the reason the session did not start, which ends in an empty line).
status=0
last_line() { awk 'NF { line = $0 } END { print line }' "$1"; }
if [ "$part" != rest ]; then
  start=$(date +%s)
  (cd "$kmtests" && $py -m pytest -q -p no:cacheprovider -rfEs "${xdist[@]}" "${parallel[@]}") > "$OUT/gpu-tests.log" 2>&1
  [ $? = 0 ] || status=1
  summary+=("verification files (${xdist[*]:-one process}): $(last_line "$OUT/gpu-tests.log") [$(($(date +%s) - start)) s]")
fi
if [ "$part" = verify ]; then
  printf '%s\n' "${summary[@]}"
  exit "$status"
fi
for f in "${serial[@]}"; do
  start=$(date +%s)
  (cd "$kmtests" && $py -m pytest -q -p no:cacheprovider -rfEs "tests/gpu/$f.py") > "$OUT/$f.log" 2>&1
  [ $? = 0 ] || status=1
  summary+=("$f: $(last_line "$OUT/$f.log") [$(($(date +%s) - start)) s]")
done
km bench softmax --shape 8192x8192 --dtype float16 2>&1 | tee "$OUT/bench-softmax.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then
  status=1
  summary+=("bench softmax: failed (exit $rc), $OUT/bench-softmax.txt")
fi
# Issue 3's acceptance (CHECK_SERVE=1): a served tuning job over REST, against torch.softmax in the same job.
if [ "${CHECK_SERVE:-0}" = 1 ]; then
  export KERNELMILL_DATABASE_URL=sqlite:////tmp/kernelmill-check.db
  (cd /tmp && exec "$py" -m kernelmill serve --port 8000) > "$OUT/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/api/health > /dev/null && break; sleep 0.5; done
  curl -s http://127.0.0.1:8000/api/workers
  echo
  (cd /tmp && timeout 480 "$py" -m kernelmill tune softmax --shape 8192x8192 --dtype float16 --budget 64 \
    --server http://127.0.0.1:8000) 2>&1 | tail -5
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    status=1
    summary+=("served tune: failed (exit $rc), $OUT/serve.log")
  fi
  km kernels --server http://127.0.0.1:8000
fi
printf '%s\n' "${summary[@]}"
exit "$status"
