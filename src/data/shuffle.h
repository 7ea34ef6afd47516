// Deterministic randomness for the data pipeline: the same seed gives the same order on every
// platform and standard library. std::uniform_int_distribution is implementation-defined, so the
// mapping from std::mt19937_64 output (which the standard fixes) to a range is our own.
#pragma once
#include <cstdint>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

namespace titan::data {

// SplitMix64 finalizer: a fast, well-mixed 64-bit hash.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t hash_combine(uint64_t a, uint64_t b) {
  return mix64(a ^ mix64(b + 0x632be59bd9b4e019ull));
}

// FNV-1a: a stable hash of a string (file paths name documents in the validation split).
inline uint64_t hash_string(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Maps a hash to [0, 1) with 53 bits of precision.
inline double hash_to_unit(uint64_t h) {
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

// Uniform integer in [0, n) by rejection sampling, n > 0.
inline uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;  // largest multiple of n, exclusive
  uint64_t x;
  do x = rng();
  while (x >= limit);
  return x % n;
}

// Fisher-Yates with our own uniform mapping.
template <class T>
void seeded_shuffle(std::vector<T>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[uniform_below(rng, i)]);
}

// A pseudo-random permutation of [0, n) evaluated pointwise in O(1) memory: a balanced Feistel
// network over the next even power of two >= n, with cycle walking back into [0, n). This lets a
// corpus of billions of documents be visited in shuffled order without storing the order.
class FeistelPermutation {
 public:
  FeistelPermutation(uint64_t n, uint64_t key) : n_(n), key_(key) {
    int bits = 2;
    while (bits < 64 && (uint64_t{1} << bits) < n) bits += 2;
    half_bits_ = bits / 2;
    half_mask_ = (uint64_t{1} << half_bits_) - 1;
  }
  uint64_t size() const { return n_; }
  uint64_t operator()(uint64_t i) const {
    if (n_ <= 1) return i;
    uint64_t x = i;
    do x = encrypt(x);  // terminates: x lies on a cycle of the permutation that contains i < n
    while (x >= n_);
    return x;
  }

 private:
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const {
    uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (int r = 0; r < kRounds; ++r) {
      const uint64_t f = mix64(right ^ hash_combine(key_, static_cast<uint64_t>(r))) & half_mask_;
      const uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    return (left << half_bits_) | right;
  }
  uint64_t n_, key_;
  int half_bits_;
  uint64_t half_mask_;
};

}  // namespace titan::data
