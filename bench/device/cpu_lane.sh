#!/usr/bin/env bash
# Issue 16 on the GPU machine's host CPU: which forced settings reproduce the AVX2 rounding, and does the old
# code (carried in .old) fail under them; then the whole CPU suite on that machine's torch (issue 17, item 7).
# Run through the device tool with carry [".old", ".whl"]; logs land in $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $OUT/cpu.txt
python3 -c "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())" >> $OUT/cpu.txt
cat $OUT/cpu.txt | cut -c1-200
PYTHONPATH=$PWD:/tmp/site python3 -m bench.cpu_kernels 2>&1 | tee $OUT/kernels.txt
FAILING="tests/test_tracing.py::test_every_mode_is_bitwise_eager_at_world_size_one tests/test_boost_w1.py::test_clipping_equals_clip_grad_norm_ tests/test_boost_w1.py::test_world_size_one_is_the_eager_step tests/test_real_models_w1.py::test_bitwise_eager tests/test_safety.py"
for setting in "" "MKL_ENABLE_INSTRUCTIONS=AVX2" "ATEN_CPU_CAPABILITY=avx2" "ONEDNN_MAX_CPU_ISA=AVX2"; do
  echo "== old code, setting: ${setting:-as found}"
  (cd .old && env $setting PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -p no:cacheprovider -x -o addopts="" $FAILING 2>&1 | tail -2)
done | tee $OUT/old.txt
echo "== new code, whole suite, torch as found"
PYTHONPATH=$PWD:/tmp/site timeout 330 python3 -m pytest -p no:cacheprovider -n 8 2>&1 | tail -25 | tee $OUT/suite.txt
