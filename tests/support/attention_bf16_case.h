// An attention_bf16 case shared by the kernel tests (every CPU implementation) and the CUDA tests: q, k and v
// are column ranges of one fused QKV row with padding (ld > (nH + 2 nKV) hd), out and dout rows padded too,
// every padding element a sentinel that no implementation may write. The expectation is the definition in
// double on the bf16 values (the backward from the bf16-rounded out, D = rowsum(dout * out), as cuDNN and the
// op's contract have it): out and dq/dk/dv within one bf16 unit in the last place (the rounding of an f32
// result) plus f32 summation noise of 1e-4 of the tensor's largest element, lse within 1e-5.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "testing.h"

namespace titan::testing {

struct AttentionBf16Case {
  static constexpr uint16_t kSentinel = 0x7fc1;  // a NaN no rounding produces
  AttentionBf16Shape s;
  std::vector<int32_t> doc_start;   // empty: causal over the whole row
  std::vector<uint16_t> qkv, dout;  // qkv rows of ldq = ldk = ldv; dout rows of ldo
  // f32 reference results of the bf16 values
  std::vector<float> out, lse, dq, dk, dv;

  AttentionBf16Case(int64_t B, int64_t T, int64_t nH, int64_t nKV, int64_t hd, uint64_t seed,
                    std::vector<int32_t> starts = {})
      : doc_start(std::move(starts)) {
    const int64_t N = B * T, qw = nH * hd, kw = nKV * hd, ld = qw + 2 * kw + 3, ldo = qw + 5;
    s = {B, T, nH, nKV, hd, ld, ld, ld, ldo};
    auto bits = [](const std::vector<float>& x) {
      std::vector<uint16_t> b(x.size());
      for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
      return b;
    };
    const auto q32 = randn(N * qw, seed), k32 = randn(N * kw, seed + 1), v32 = randn(N * kw, seed + 2),
               do32 = randn(N * qw, seed + 3);
    qkv.assign(N * ld, kSentinel);
    dout.assign(N * ldo, kSentinel);
    const auto qb = bits(q32), kb = bits(k32), vb = bits(v32), dob = bits(do32);
    for (int64_t n = 0; n < N; ++n) {
      std::copy_n(qb.begin() + n * qw, qw, qkv.begin() + n * ld);
      std::copy_n(kb.begin() + n * kw, kw, qkv.begin() + n * ld + qw);
      std::copy_n(vb.begin() + n * kw, kw, qkv.begin() + n * ld + qw + kw);
      std::copy_n(dob.begin() + n * qw, qw, dout.begin() + n * ldo);
    }
    // The definition, in double, on the bf16 values: P = softmax(scale q k^T) over the row's keys, out = P v,
    // lse = its logsumexp; the backward from the bf16-rounded out, as the op's contract says (D = dout .
    // out).
    const auto q = unpack(qkv.data(), N, qw, ld), k = unpack(qkv.data() + qw, N, kw, ld),
               v = unpack(qkv.data() + qw + kw, N, kw, ld), d = unpack(dout.data(), N, qw, ldo);
    const int32_t* ds = docs();
    const double scale = 1.0 / std::sqrt((double)hd);
    std::vector<double> oq(N * qw), gq(N * qw), gk(N * kw), gv(N * kw);
    out.assign(N * qw, 0.0f), lse.assign(B * nH * T, 0.0f);
    std::vector<double> p(T);
    for (int pass = 0; pass < 2; ++pass)  // 0: forward, 1: backward (needs the rounded out of pass 0)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < nH; ++h)
          for (int64_t i = 0; i < T; ++i) {
            const int64_t lo = attention_key_start(ds, b, T, i), qi = ((b * T + i) * nH + h) * hd;
            auto kv = [&](int64_t j) { return ((b * T + j) * nKV + h / (nH / nKV)) * hd; };
            double mx = -INFINITY, sum = 0;
            for (int64_t j = lo; j <= i; ++j) {
              double dot = 0;
              for (int64_t e = 0; e < hd; ++e) dot += (double)q[qi + e] * k[kv(j) + e];
              mx = std::max(mx, p[j] = dot * scale);
            }
            for (int64_t j = lo; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
            for (int64_t j = lo; j <= i; ++j) p[j] /= sum;
            if (pass == 0) {
              for (int64_t j = lo; j <= i; ++j)
                for (int64_t e = 0; e < hd; ++e) oq[qi + e] += p[j] * v[kv(j) + e];
              for (int64_t e = 0; e < hd; ++e) out[qi + e] = (float)oq[qi + e];
              lse[(b * nH + h) * T + i] = (float)(mx + std::log(sum));
              continue;
            }
            double D = 0;
            for (int64_t e = 0; e < hd; ++e) D += (double)d[qi + e] * round_to_bf16(out[qi + e]);
            for (int64_t j = lo; j <= i; ++j) {
              double dp = 0;
              for (int64_t e = 0; e < hd; ++e) dp += (double)d[qi + e] * v[kv(j) + e];
              const double dsj = p[j] * (dp - D) * scale;
              for (int64_t e = 0; e < hd; ++e) {
                gv[kv(j) + e] += p[j] * d[qi + e];
                gq[qi + e] += dsj * k[kv(j) + e];
                gk[kv(j) + e] += dsj * q[qi + e];
              }
            }
          }
    dq.assign(gq.begin(), gq.end()), dk.assign(gk.begin(), gk.end()), dv.assign(gv.begin(), gv.end());
  }

  static std::vector<float> unpack(const uint16_t* p, int64_t rows, int64_t width, int64_t ld) {
    std::vector<float> x(rows * width);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) x[r * width + c] = bf16_to_f32(p[r * ld + c]);
    return x;
  }

  // got: columns [col0, col0 + width) of rows of stride ld (bf16) against want (rows, width) f32. Empty when
  // within one bf16 ulp plus 1e-4 of the largest element, else the first offending element. (The f32 noise:
  // a gradient element is a sum over up to T rows of terms as large as the tensor's largest element that
  // cancel to a small value; f32 scores and exponentials leave ~1e-5 of the terms' size in it.)
  static std::string check(const std::vector<uint16_t>& got, int64_t col0, int64_t width, int64_t ld,
                           const std::vector<float>& want) {
    const int64_t rows = static_cast<int64_t>(want.size()) / width;
    float mx = 0;
    for (float w : want) mx = std::max(mx, std::abs(w));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) {
        const float g = bf16_to_f32(got[r * ld + col0 + c]), w = want[r * width + c];
        if (!(std::abs(g - w) <= std::ldexp(std::abs(w), -7) + 1e-4f * mx))
          return "row " + std::to_string(r) + " col " + std::to_string(c) + ": " + std::to_string(g) +
                 " vs " + std::to_string(w);
      }
    return "";
  }
  // What an implementation's results get wrong (empty: nothing): out (rows of ldo) and lse from the forward,
  // dqkv (rows of ldq, filled with the sentinel before the backward) from the backward.
  std::vector<std::string> failures(const std::vector<uint16_t>& got_out, const std::vector<float>& got_lse,
                                    const std::vector<uint16_t>& dqkv) const {
    std::vector<std::string> f;
    const int64_t qw = s.nH * s.hd, kw = s.nKV * s.hd;
    auto add = [&f](const char* what, const std::string& why) {
      if (!why.empty()) f.push_back(std::string(what) + ": " + why);
    };
    add("out", check(got_out, 0, qw, s.ldo, out));
    if (!padding_intact(got_out, qw, s.ldo)) f.push_back("out: a padding column was written");
    for (size_t i = 0; i < lse.size(); ++i)
      if (!(std::abs(got_lse[i] - lse[i]) <= 1e-5f * std::max(1.0f, std::abs(lse[i])))) {
        f.push_back("lse[" + std::to_string(i) + "] = " + std::to_string(got_lse[i]) + " vs " +
                    std::to_string(lse[i]));
        break;
      }
    add("dq", check(dqkv, 0, qw, s.ldq, dq));
    add("dk", check(dqkv, qw, kw, s.ldq, dk));
    add("dv", check(dqkv, qw + kw, kw, s.ldq, dv));
    if (!padding_intact(dqkv, qw + 2 * kw, s.ldq)) f.push_back("dqkv: a padding column was written");
    return f;
  }
  const int32_t* docs() const { return doc_start.empty() ? nullptr : doc_start.data(); }

  // Whether the padding columns [used, ld) of every row still hold the sentinel.
  static bool padding_intact(const std::vector<uint16_t>& x, int64_t used, int64_t ld) {
    for (size_t i = 0; i < x.size(); ++i)
      if (static_cast<int64_t>(i) % ld >= used && x[i] != kSentinel) return false;
    return true;
  }
};

}  // namespace titan::testing
