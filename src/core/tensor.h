// Tensor: a contiguous, row-major view into reference-counted device storage.
// Layers keep their parameters in one flat buffer and hand out views (DESIGN: flat buffers per layer).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "device/device.h"

namespace titan {

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"

// Owns bytes on one device; frees them through that device's allocator.
struct Storage {
  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  Storage(size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor from_vector(const std::vector<float>& values, Shape shape);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::cpu(); }

  void* raw() const { return static_cast<char*>(storage_->data) + offset_; }
  template <class T>
  T* data() const {
    return static_cast<T*>(raw());
  }
  float* f32() const;  // checks dtype == F32

  // Same storage, new shape with the same numel.
  Tensor view(Shape shape) const;
  // A contiguous sub-block: elements [offset, offset + numel(shape)) of this tensor.
  Tensor view_at(int64_t elem_offset, Shape shape) const;
  Tensor clone() const;
  Tensor to(DType dtype) const;    // converting copy (f32 <-> bf16) on the same device
  Tensor to(Device device) const;  // copy on another device (this tensor itself when already there)
  void zero_();
  // Same numel; converts dtype (f32 <-> bf16) and crosses devices (through host memory).
  void copy_from(const Tensor& src);
  // Raw bytes between this tensor (any device) and host memory: nbytes() of them.
  void copy_to_host(void* dst) const;
  void copy_from_host(const void* src);

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::F32;
};

}  // namespace titan
