# Sourced by the GPU scripts: finds the machine's cuBLASLt, NCCL, cuDNN and NVRTC (the toolkit's lib64, else
# the pip wheels') and sets TITAN_LD, the library path of the bundled binaries (/tmp/tb/lib first).
LT=$(ls /usr/local/cuda/lib64/libcublasLt.so.13 /usr/local/cuda*/lib64/libcublasLt.so.13 \
  /opt/*/.venv/lib/python3*/site-packages/nvidia/cu13/lib/libcublasLt.so.13 \
  /usr/local/lib/python3*/dist-packages/nvidia/cu13/lib/libcublasLt.so.13 2>/dev/null | head -1)
NCCL=$(ls /usr/local/cuda*/lib64/libnccl.so.2 2>/dev/null | head -1)
[ -n "$NCCL" ] || NCCL=$(find /usr /opt -name 'libnccl.so.2' 2>/dev/null | head -1)
# cuDNN loads its sub-libraries (libcudnn_graph, libcudnn_engines_*, ...) from the library path too, so
# the whole directory of libcudnn.so.9 goes on it.
CUDNN=$(ls /usr/local/cuda/lib64/libcudnn.so.9 /usr/local/cuda*/lib64/libcudnn.so.9 \
  /opt/*/.venv/lib/python3*/site-packages/nvidia/cudnn/lib/libcudnn.so.9 \
  /usr/local/lib/python3*/dist-packages/nvidia/cudnn/lib/libcudnn.so.9 2>/dev/null | head -1)
[ -n "$CUDNN" ] || CUDNN=$(find /usr /opt -name 'libcudnn.so.9' 2>/dev/null | head -1)
NVRTC=$(ls /usr/local/cuda/lib64/libnvrtc.so.13 /usr/local/cuda*/lib64/libnvrtc.so.13 \
  /opt/*/.venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 \
  /usr/local/lib/python3*/dist-packages/nvidia/cu13/lib/libnvrtc.so.13 2>/dev/null | head -1)
[ -n "$NVRTC" ] || NVRTC=$(find /usr /opt -name 'libnvrtc.so.13' 2>/dev/null | head -1)
TITAN_LD="/tmp/tb/lib:$(dirname "${LT:-/usr/local/cuda/lib64/x}"):$(dirname "${NCCL:-/usr/local/cuda/lib64/x}")"
TITAN_LD="$TITAN_LD:$(dirname "${CUDNN:-/usr/local/cuda/lib64/x}"):$(dirname "${NVRTC:-/usr/local/cuda/lib64/x}")"
export TITAN_LD
