#!/usr/bin/env bash
# The checks a GPU machine owes, most valuable first, each under its own time limit, every log in OUTDIR:
#   1. devices.txt  glm-run --list-devices (what the driver reports, the measured placement)
#   2. tests.txt    the kernel, OpenCL backend, decode step (MTP's two-row step and the batch over sequences too)
#                   and device sampling tests on the GPU (glm-validate on every oracle fixture)
#   3. profile.txt  tools/profile_decode.py: where a decoded token's time goes on the device decode step
#   4. bench.*      tools/bench.py, one run each of every operation on the GPU and of auto
#   5. hybrid.txt   tools/bench_hybrid.py --gpu: a GPU budget of 25% of the bench model, the experts over it on
#                   the NumPy path or on PoCL's CPU device (needs PoCL beside the GPU driver)
#   6. sampling.txt tools/bench_sampling.py: sampled (drawn on the device, and by the host) against greedy decode
#   7. constrained.txt tools/bench_constrained.py: JSON and tool grammars against free decoding (on a discrete GPU
#                   through the host's choice: what pipelining them there would gain)
#   8. mtp.txt      tools/bench.py on the trained fixture (a real MTP head): MTP on against off on the step
#   9. batch.txt    tools/bench_batch.py: forwards of B sequences on the step (and through the batch's pipeline)
#                   against single-token forwards
#  10. forms.txt    tools/bench_hybrid.py --gpu --forms: the split step's MTP verification and batch (a GPU budget of
#                   40% of the trained fixture, PoCL beside it)
#
#   tools/gpu_check.sh OUTDIR [KIND] [BENCH_WORK]    KIND: gpu (default) or cpu; BENCH_WORK: the bench model's home
# Needs pyopencl and a registered OpenCL driver (ICD). Exits 1 when no device of KIND is found.
# A GPU machine without PyPI: bring cp312 wheels of pyopencl, pytools, platformdirs, siphash24, zstandard, starlette
# and uvicorn in an ignored .whl/ (step 5 also needs pocl-binary-distribution, PoCL's CPU device: a 58 MB wheel,
# which with the rest outgrows a 64 MiB carry; without it step 5 reports no CPU device), then
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site \
#       tools/gpu_check.sh OUT gpu
set -u
out=${1:?usage: tools/gpu_check.sh OUTDIR [KIND] [BENCH_WORK]}
kind=${2:-gpu}
work=${3:-/tmp/glmkit-bench-model}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: the command's output in OUTDIR/NAME.txt, its status and tail here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "== $name: rc=$? in $((SECONDS - start)) s"
    tail -n 6 "$out/$name.txt"
}

# an image with NVIDIA's driver but no ICD file for it (seen on the H200 machines): register the driver's library
nvidia_cl=$(ldconfig -p | grep -o '/[^ ]*libnvidia-opencl.so[.0-9]*' | head -1)
if [ -n "$nvidia_cl" ] && ! grep -qs libnvidia-opencl /etc/OpenCL/vendors/*.icd; then
    mkdir -p /etc/OpenCL/vendors && echo "$nvidia_cl" >/etc/OpenCL/vendors/nvidia.icd
fi
dev=$(python3 -c "
from glmkit.backends.opencl.device import list_devices
found = [d for d in list_devices() if d.kind == '$kind']
print(found[0].spec.removeprefix('opencl:') if found else '')")
if [ -z "$dev" ]; then
    echo "no OpenCL $kind device"
    exit 1
fi
echo "device opencl:$dev"
step devices 60 python3 -m glmkit.cli.run --list-devices
step tests 200 env GLMKIT_TEST_DEVICE="$dev" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/test_kernels_cl.py tests/test_opencl_backend.py tests/test_decode_step.py tests/test_device_sampling.py \
    tests/test_mtp_step.py \
    tests/test_serve_batching.py::test_batched_decode_on_opencl_is_each_sequence_on_the_device_step_alone \
    tests/test_serve_batching.py::test_opencl_batch_takes_requests_that_join_and_leave \
    tests/test_serve_batching.py::test_opencl_batch_stores_lower_precision_rows_as_each_sequence_alone \
    tests/test_serve_batching.py::test_pipelined_batch_is_decode_batch_and_the_argmax \
    tests/test_serve_batching.py::test_pipelined_batch_draws_each_row_as_its_sampler
step profile 150 python3 tools/profile_decode.py --tokens 40 --work "$work"
step bench 240 python3 tools/bench.py --devices "opencl:$dev,auto" --runs 1 --work "$work" \
    --json "$out/bench.json" --md "$out/bench.md"
step hybrid 150 python3 tools/bench_hybrid.py --gpu --runs 2 --work "$work"
step sampling 150 python3 tools/bench_sampling.py --rounds 3 --work "$work"
step constrained 120 python3 tools/bench_constrained.py --rounds 2 --max-tokens 100 --vocab 0 --work "$work"
step mtp 150 bash -c "python3 -m glmkit.cli.convert tests/fixtures/tiny-trained /tmp/gpu-check-tt-q4 --preset q4 \
    --force >/dev/null && python3 tools/bench.py --snapshot /tmp/gpu-check-tt-q4 --preset q4 \
    --devices opencl:$dev --runs 1 --mtp-rounds 3 --decode 128 --prompt 48 \
    --prompt-tokens tests/fixtures/tiny-trained/eval_tokens.json"
step batch 150 python3 tools/bench_batch.py --device "opencl:$dev" --rounds 3 --snapshot "$work/q4"
step forms 120 python3 tools/bench_hybrid.py --gpu --forms --snapshot /tmp/gpu-check-tt-q4 --budget 0.4 --runs 3 \
    --tokens 64
