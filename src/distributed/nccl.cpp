#include "distributed/nccl.h"

#include "core/error.h"

namespace titan::dist {

NcclGroupFactory& nccl_group_factory() {
  static NcclGroupFactory f = nullptr;
  return f;
}

bool nccl_available() {
  return nccl_group_factory() != nullptr;
}

std::shared_ptr<ProcessGroup> make_nccl_group(ProcessGroup& bootstrap) {
  TITAN_CHECK(nccl_available(),
              "NCCL process group requested, but titan was built without NCCL "
              "(configure with -DTITAN_CUDA=ON on a machine with NCCL)");
  return nccl_group_factory()(bootstrap);
}

}  // namespace titan::dist
