# Sourced by the GPU scripts: installs WHEEL into a private folder and sets
# the environment every GPU run uses (loopback, NVLink multicast off).
#   . benchmarks/device_env.sh WHEEL
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$1" || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TCPX_P2P_IFNAME=lo
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The GPUs a two-process pair runs on: sets NGPU (GPUs seen) and GPUS
# (0,1 with two or more, both sides on 0 with one).
pair_gpus() {
  NGPU=$(python3 -c 'from tcpx_p2p import cuda_device_count; print(cuda_device_count())')
  GPUS=0,1
  [ "$NGPU" -lt 2 ] && GPUS=0,0
}
