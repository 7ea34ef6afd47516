// TITAN_HOST_DEVICE: a function compiled for the host and, by nvcc, for CUDA kernels too (the one formula
// that every device's implementation of an op shares).
#pragma once

#ifdef __CUDACC__
#define TITAN_HOST_DEVICE __host__ __device__
#else
#define TITAN_HOST_DEVICE
#endif
