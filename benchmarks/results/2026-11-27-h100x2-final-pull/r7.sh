#!/bin/bash
# Round 7: the final build (`759e751`) with reads paired again: the same-host net's
# tests and the same-host path's tests with CUDA, GPU 0 and GPU 1
set -u
D=${FILES:?a folder with the wheel w11/ (`759e751`)}
. benchmarks/device_env.sh "$(ls $D/w11/*.whl)"
nvidia-smi -L
timeout 150 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_same_host_net.py tests/test_local.py -k cuda 2>&1 | tail -3
