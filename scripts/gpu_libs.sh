# Sourced by the GPU scripts: finds the machine's cuBLASLt and NCCL (the toolkit's lib64, else the pip
# wheels') and sets TITAN_LD, the library path of the bundled binaries (/tmp/tb/lib first).
LT=$(ls /usr/local/cuda/lib64/libcublasLt.so.13 /usr/local/cuda*/lib64/libcublasLt.so.13 \
  /opt/*/.venv/lib/python3*/site-packages/nvidia/cu13/lib/libcublasLt.so.13 \
  /usr/local/lib/python3*/dist-packages/nvidia/cu13/lib/libcublasLt.so.13 2>/dev/null | head -1)
NCCL=$(ls /usr/local/cuda*/lib64/libnccl.so.2 2>/dev/null | head -1)
[ -n "$NCCL" ] || NCCL=$(find /usr /opt -name 'libnccl.so.2' 2>/dev/null | head -1)
TITAN_LD="/tmp/tb/lib:$(dirname "${LT:-/usr/local/cuda/lib64/x}"):$(dirname "${NCCL:-/usr/local/cuda/lib64/x}")"
export TITAN_LD
