#include "core/tensor.h"

#include <cstring>

#include "core/error.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Storage::Storage(size_t n, Device dev) : nbytes(n), device(dev) {
  data = device_interface(dev.type).allocator->allocate(n);
}

Storage::~Storage() {
  device_interface(device.type).allocator->deallocate(data, nbytes);
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.numel() * dtype_size(dtype), device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, Shape shape) {
  TITAN_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
              " values for shape ", shape_str(shape));
  Tensor t = empty(std::move(shape));
  std::memcpy(t.raw(), values.data(), values.size() * 4);
  return t;
}

float* Tensor::f32() const {
  TITAN_CHECK(dtype_ == DType::F32, "expected an f32 tensor, got ", dtype_name(dtype_));
  return data<float>();
}

Tensor Tensor::view(Shape shape) const {
  TITAN_CHECK(shape_numel(shape) == numel(), "view: cannot view ", shape_str(shape_), " as ",
              shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::view_at(int64_t elem_offset, Shape shape) const {
  TITAN_CHECK(elem_offset >= 0 && elem_offset + shape_numel(shape) <= numel(), "view_at: range [",
              elem_offset, ", ", elem_offset + shape_numel(shape), ") outside ", shape_str(shape_));
  Tensor t = *this;
  t.offset_ += elem_offset * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  device_interface(device().type).copy(t.raw(), raw(), nbytes());
  return t;
}

void Tensor::zero_() {
  device_interface(device().type).zero(raw(), nbytes());
}

void Tensor::copy_to_host(void* dst) const {
  device_interface(device().type).copy_to_host(dst, raw(), nbytes());
}

void Tensor::copy_from_host(const void* src) {
  device_interface(device().type).copy_from_host(raw(), src, nbytes());
}

void Tensor::copy_from(const Tensor& src) {
  TITAN_CHECK(src.numel() == numel(), "copy_from: ", shape_str(src.shape()), " into ", shape_str(shape_));
  const int64_t n = numel();
  if (src.device() != device()) {
    // Across devices: stage through host memory (same dtype), then convert where this tensor lives.
    if (src.device().type == DeviceType::CPU && src.dtype() == dtype_) return copy_from_host(src.raw());
    if (device().type == DeviceType::CPU && src.dtype() == dtype_) return src.copy_to_host(raw());
    Tensor host = empty(src.shape(), src.dtype());
    src.copy_to_host(host.raw());
    if (device().type == DeviceType::CPU) return copy_from(host);
    return copy_from(host.to(device()));
  }
  if (src.dtype() == dtype_) {
    device_interface(device().type).copy(raw(), src.raw(), nbytes());
    return;
  }
  const auto& k = get_kernel<ElementwiseKernels>(device().type);
  if (src.dtype() == DType::F32 && dtype_ == DType::BF16)
    k.to_bf16(data<uint16_t>(), src.data<float>(), n);
  else if (src.dtype() == DType::BF16 && dtype_ == DType::F32)
    k.from_bf16(data<float>(), src.data<uint16_t>(), n);
  else
    fail("copy_from: unsupported conversion ", dtype_name(src.dtype()), " -> ", dtype_name(dtype_));
}

Tensor Tensor::to(DType dtype) const {
  Tensor t = empty(shape_, dtype, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device dev) const {
  if (dev == device()) return *this;
  Tensor t = empty(shape_, dtype_, dev);
  t.copy_from(*this);
  return t;
}

}  // namespace titan
