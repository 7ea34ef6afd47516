// Element types. Compute is f32; bf16 is a storage/compute option; i32 holds token ids, i64 row indices,
// f64 accumulated statistics.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace titan {

enum class DType : uint8_t { F32, BF16, I32, I64, F64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);           // "f32", "bf16", "i32", "i64", "f64"
const char* dtype_safetensors(DType t);    // "F32", "BF16", "I32", "I64", "F64"
DType parse_dtype(std::string_view name);  // accepts f32/float32/bf16/bfloat16; throws otherwise

// bfloat16 <-> float. Rounds to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// The nearest bfloat16 value of f, as a float (what a bf16 GEMM operand holds).
inline float round_to_bf16(float f) {
  return bf16_to_f32(f32_to_bf16(f));
}
// IEEE half -> float (for reading F16 checkpoints).
float f16_to_f32(uint16_t h);

}  // namespace titan
