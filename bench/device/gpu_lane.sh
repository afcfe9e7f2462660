#!/usr/bin/env bash
# The GPU test lane and the CPU suite on the GPU machine's torch (issue 17). Run through the device tool with
# carry [".whl"] (pydot's wheel); logs land in $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers, torchvision; print('torch', torch.__version__, 'transformers', transformers.__version__, 'torchvision', torchvision.__version__)" | tee -a $OUT/gpu.txt
echo "== GPU lane"
timeout 300 python3 -m pytest -m gpu -s -rA -p no:cacheprovider -o addopts="" tests/test_gpu.py 2>&1 | grep -E "GPU |PASSED|FAILED|passed|failed|^E " | head -80 | tee $OUT/gpu_lane.txt
echo "== CPU suite on this torch"
timeout 420 python3 -m pytest -p no:cacheprovider -o addopts="" -q -n 14 -m "not gpu" 2>&1 | grep -E "passed|failed|FAILED|ERROR" | head -30 | tee $OUT/cpu_suite.txt
