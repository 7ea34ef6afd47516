#include "distributed/staged_process_group.h"

#include <vector>

namespace titan::dist {

namespace {

class HostStagedGroup final : public ProcessGroup {
 public:
  HostStagedGroup(ProcessGroup& host, std::shared_ptr<ProcessGroup> owned, Device device)
      : host_(host), owned_(std::move(owned)), dev_(device_interface(device.type)), device_(device) {}

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  int world_rank_of(int r) const override { return host_.world_rank_of(r); }
  ProcessGroup& host_group() override { return host_; }
  std::string backend() const override { return host_.backend() + "+staged:" + device_.str(); }

  void all_reduce(void* buf, int64_t count, CommType type, ReduceOp op) override {
    auto h = to_host(buf, count, type);
    host_.all_reduce(h.data(), count, type, op);
    from_host(buf, h);
  }
  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& recv_counts, CommType type,
                      ReduceOp op) override {
    auto s = to_host(send, sum(recv_counts), type);
    std::vector<char> r(bytes(recv_counts[rank()], type));
    host_.reduce_scatter(s.data(), r.data(), recv_counts, type, op);
    from_host(recv, r);
  }
  void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, CommType type) override {
    auto s = to_host(send, counts[rank()], type);  // staged first: send may lie inside recv
    std::vector<char> r(bytes(sum(counts), type));
    host_.all_gather(s.data(), r.data(), counts, type);
    from_host(recv, r);
  }
  void broadcast(void* buf, int64_t count, CommType type, int root) override {
    auto h = to_host(buf, count, type);
    host_.broadcast(h.data(), count, type, root);
    from_host(buf, h);
  }
  void all_to_all(const void* send, void* recv, int64_t count, CommType type) override {
    auto s = to_host(send, count * size(), type);
    std::vector<char> r(s.size());
    host_.all_to_all(s.data(), r.data(), count, type);
    from_host(recv, r);
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, CommType type) override {
    auto s = to_host(send, sum(send_counts), type);
    std::vector<char> r(bytes(sum(recv_counts), type));
    host_.all_to_all_v(s.data(), send_counts, r.data(), recv_counts, type);
    from_host(recv, r);
  }
  void barrier() override { host_.barrier(); }
  void send(const void* buf, int64_t count, CommType type, int dst) override {
    auto h = to_host(buf, count, type);
    host_.send(h.data(), count, type, dst);  // copied by the host group
  }
  void recv(void* buf, int64_t count, CommType type, int src) override {
    std::vector<char> h(bytes(count, type));
    host_.recv(h.data(), count, type, src);
    from_host(buf, h);
  }
  void wait_sends() override { host_.wait_sends(); }
  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    std::shared_ptr<ProcessGroup> sub = host_.split(color, key);
    ProcessGroup& ref = *sub;
    return std::make_shared<HostStagedGroup>(ref, std::move(sub), device_);
  }

 private:
  static int64_t sum(const std::vector<int64_t>& v) {
    int64_t s = 0;
    for (int64_t x : v) s += x;
    return s;
  }
  static size_t bytes(int64_t count, CommType type) {
    return static_cast<size_t>(count) * comm_type_size(type);
  }
  std::vector<char> to_host(const void* p, int64_t count, CommType type) const {
    std::vector<char> h(bytes(count, type));
    if (!h.empty()) dev_.copy_to_host(h.data(), p, h.size());
    return h;
  }
  void from_host(void* p, const std::vector<char>& h) const {
    if (!h.empty()) dev_.copy_from_host(p, h.data(), h.size());
  }

  ProcessGroup& host_;
  std::shared_ptr<ProcessGroup> owned_;  // a split's sub-group (null for the world group)
  DeviceInterface& dev_;
  Device device_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_host_staged_group(ProcessGroup& host, Device device) {
  return std::make_shared<HostStagedGroup>(host, nullptr, device);
}

}  // namespace titan::dist
