// NCCL process group: the collectives of dist::ProcessGroup on GPU buffers (device pointers of the CUDA
// device), one rank per GPU, beside the MPI group that starts the ranks. Built with the CUDA device when
// CMake finds NCCL; elsewhere make_nccl_group throws a titan::Error saying so.
//
//   auto& world = titan::dist::init();                  // MPI (or single) group: starts the ranks
//   auto gpu = titan::dist::make_nccl_group(world);     // same ranks, same order, GPU collectives
//   gpu->all_reduce(device_grads, n, CommType::F32, ReduceOp::Avg);
//
// Every call is blocking (returns after the collective finished on the device), as the interface says.
// Each rank uses the current CUDA device (the caller picks it, usually the local rank).
#pragma once
#include <memory>

#include "distributed/process_group.h"

namespace titan::dist {

bool nccl_available();
// Collective over `bootstrap`: rank 0 makes the NCCL id and broadcasts it through `bootstrap`.
std::shared_ptr<ProcessGroup> make_nccl_group(ProcessGroup& bootstrap);

// Set by the NCCL implementation's static initializer (src/distributed/nccl_process_group.cu).
using NcclGroupFactory = std::shared_ptr<ProcessGroup> (*)(ProcessGroup& bootstrap);
NcclGroupFactory& nccl_group_factory();

}  // namespace titan::dist
