#!/usr/bin/env bash
# The device checks of issues 17 (Kimi-shape step on one GPU) and the flex formulation's backward
# (tests/test_model.py's cuda cases). One prepared script for a single H200/B300 session:
#   bash bench/gpu_check.sh            # writes outputs/bench/gpu/*
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-outputs/bench/gpu}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_model.py -k cuda 2>&1 | tail -25 | tee "$out/test_model_cuda.txt"
for attn in flex chunked; do
  timeout 240 python3 bench/kimi_shapes.py --gpu --steps 3 --attention $attn 2>&1 | grep -v "^  " | tee "$out/kimi_$attn.txt"
  cp outputs/bench/kimi_shapes.json "$out/kimi_$attn.json" 2>/dev/null
done
