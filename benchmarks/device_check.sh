#!/usr/bin/env bash
# One call on a GPU host: the gpu tests (one process per op, so a fault cannot poison the others),
# the softmax bench next to PyTorch, and a served tuning job over REST. Logs go to $OUT (or ./out).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# pytest puts the rootdir on sys.path, where the source folder kernelmill/ would shadow the installed
# package (whose subpackages live in other folders): run the tests from a copy.
rm -rf /tmp/kmtests && mkdir -p /tmp/kmtests && cp -r tests pyproject.toml /tmp/kmtests/
py="python3"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
for sel in "softmax or planted or unwritten" "matmul" "fused_mlp"; do
  (cd /tmp/kmtests && $py -m pytest tests/gpu/test_families_gpu.py -q -p no:cacheprovider -k "$sel") 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -15
done
(cd /tmp/kmtests && $py -m pytest tests/gpu/test_service_gpu.py tests/gpu/test_multi_gpu.py -q -p no:cacheprovider) 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -15
kernelmill bench softmax --shape 8192x8192 --dtype float16 2>&1 | tee "$OUT/bench-softmax.txt"
# Issue 3's acceptance (CHECK_SERVE=1): a served tuning job over REST, against torch.softmax in the same job.
[ "${CHECK_SERVE:-0}" = 1 ] || exit 0
export KERNELMILL_DATABASE_URL=sqlite:////tmp/kernelmill-check.db
kernelmill serve --port 8000 > "$OUT/serve.log" 2>&1 &
for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/api/health > /dev/null && break; sleep 0.5; done
curl -s http://127.0.0.1:8000/api/workers; echo
timeout 480 kernelmill tune softmax --shape 8192x8192 --dtype float16 --budget 64 --server http://127.0.0.1:8000 2>&1 | tail -5
kernelmill kernels --server http://127.0.0.1:8000
