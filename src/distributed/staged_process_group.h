// Collectives of device buffers through a host process group: every call copies the device buffers to
// host memory, runs the host group's collective there and copies the result back. For devices whose
// memory MPI cannot read (an accelerator without a device-aware transport, the guard device); NCCL is the
// fast path for CUDA (distributed/nccl.h).
#pragma once
#include <memory>

#include "device/device.h"
#include "distributed/process_group.h"

namespace titan::dist {

// `host` must outlive the returned group (the world group from init() does).
std::shared_ptr<ProcessGroup> make_host_staged_group(ProcessGroup& host, Device device);

}  // namespace titan::dist
