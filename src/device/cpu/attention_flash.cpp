// Tiled ("flash") causal attention: online softmax over key blocks in the forward, which saves only the
// row logsumexp (B,nH,T); the backward recomputes each probability tile from it. No [T,T] buffer exists:
// the working set is one (rep*kBlock x kBlock) score tile and one (rep*kBlock x hd) output accumulator per
// thread: the rep query heads that share a kv head (GQA) are stacked into one tile (stack_group_rows).
// Tiles are single-threaded GEMMs inside the OpenMP tasks (oneDNN's sgemm where built, else BLAS); tiles
// above the diagonal are skipped.
//
// forward, per (b, kv head) and query block I (its rep query heads stacked):   m = -inf, l = 0, O = 0
//   for key blocks J <= I:  S = scale Q_I K_J^T (causal mask on the diagonal tile)
//                           m' = max(m, rowmax S);  P = exp(S - m');  c = exp(m - m')
//                           l = c l + rowsum P;  O = c O + P V_J;  m = m'
//   out_I = O / l;  lse_I = m + log l
// backward, per (b, kv head) so the dK/dV accumulation of the group's query heads never races:
//   D_i = dO_i . O_i;  for key blocks J and query blocks I >= J (the group's query heads stacked):
//   P = exp(scale Q_I K_J^T - lse_I);  dV_J += P^T dO_I;  dP = dO_I V_J^T;  dS = P (dP - D_I) scale
//   dQ_I += dS K_J;  dK_J += dS^T Q_I
// Packed rows (doc_start): row i also masks the keys before its document's start; key blocks wholly before
// the documents of a query block are skipped (doc_start never decreases along a row).
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "device/cpu/sgemm.h"
#include "device/cpu/vec_math.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

// Where the tile GEMMs run. "flash": BLAS, 64 x 64 tiles. "flash_onednn": oneDNN's sgemm, which runs its
// kernels by cpuid whatever OpenBLAS's core type, on 128 x 128 tiles (score tile 64 KiB): 1.5x "flash" at
// T = 512 and 2x at T = 4096 (bench_attention, 2 threads, bench/BENCHMARKS.md); the default where built.
// After 5 AdamW steps one rarely routed expert of the e8k2_norm MoE fixture lands 1.04e-4 from HF's
// float32 result, but 5.5e-6 from the float64 run where HF float32 itself is 9.9e-5 away: the fixtures
// now judge parameters against that float64 truth (tests/support/golden.h) and pass with either engine.
enum class TileEngine { kBlas, kOneDnn };

template <TileEngine E>
constexpr int64_t kBlock = E == TileEngine::kOneDnn ? 128 : 64;

// C = alpha op(A) op(B) + beta C, row-major, single-threaded (called inside OpenMP tasks).
template <TileEngine E>
void tile_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if constexpr (E == TileEngine::kOneDnn) {
    cpu::sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, lda, B, ldb, beta, C, ldc);
}

int64_t flash_saved_floats(int64_t B, int64_t T, int64_t nH) {
  return B * nH * T;
}

// The query rows of the rep heads sharing kv head kh, for query block [i0, i0 + br), stacked into one
// (rep*br, hd) matrix: row g*br + r is head kh*rep + g at position i0 + r. With GQA every tile GEMM then
// covers the whole group (rep times the rows, one packing of the K/V tile instead of rep).
void stack_group_rows(float* dst, const float* src, int64_t b, int64_t T, int64_t i0, int64_t br, int64_t kh,
                      int64_t rep, int64_t ld, int64_t hd) {
  for (int64_t g = 0; g < rep; ++g)
    for (int64_t r = 0; r < br; ++r)
      std::copy_n(src + (b * T + i0 + r) * ld + (kh * rep + g) * hd, hd, dst + (g * br + r) * hd);
}

// D_i = dO_i . O_i of query block [i0, i0 + br), the rep heads of kv head kh stacked as stack_group_rows
// does (dob holds the block's stacked dO rows; out is the forward's output, row stride ld).
void row_dots(float* D, const float* out, const float* dob, int64_t b, int64_t T, int64_t i0, int64_t br,
              int64_t kh, int64_t rep, int64_t ld, int64_t hd) {
  for (int64_t rr = 0; rr < rep * br; ++rr) {
    const float* o = out + (b * T + i0 + rr % br) * ld + (kh * rep + rr / br) * hd;
    const float* d = dob + rr * hd;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < hd; ++c) acc += o[c] * d[c];
    D[rr] = acc;
  }
}

// One tile's gradients from its probabilities p (R = rep x br stacked rows, bc keys), all rep heads of the
// group in one GEMM each: dV_J += P^T dO_I;  dP = dO_I V_J^T;  dS = P (dP - D_I) scale;  dQ_I += dS K_J (per
// head: dq's rows are strided by head; dq points at the block's first row of the group's first head);
// dK_J += dS^T Q_I.  dp is scratch (R x bc).
template <TileEngine E>
void tile_backward(const float* p, float* dp, const float* qi, const float* doi, const float* Di,
                   const float* kj, const float* vj, float* dkj, float* dvj, float* dq, int64_t R, int64_t br,
                   int64_t bc, int64_t rep, int64_t hd, int64_t ldk, int64_t ldq, float scale) {
  tile_gemm<E>(true, false, bc, hd, R, 1.0f, p, bc, doi, hd, 1.0f, dvj, ldk);
  tile_gemm<E>(false, true, R, bc, hd, 1.0f, doi, hd, vj, ldk, 0.0f, dp, bc);
  for (int64_t rr = 0; rr < R; ++rr) {
    const float* pr = p + rr * bc;
    float* dr = dp + rr * bc;
    const float d = Di[rr];
#pragma omp simd
    for (int64_t c = 0; c < bc; ++c) dr[c] = pr[c] * (dr[c] - d) * scale;
  }
  for (int64_t g = 0; g < rep; ++g)
    tile_gemm<E>(false, false, br, hd, bc, 1.0f, dp + g * br * bc, bc, kj, ldk, 1.0f, dq + g * hd, ldq);
  tile_gemm<E>(true, false, bc, hd, R, 1.0f, dp, bc, qi, hd, 1.0f, dkj, ldk);
}

template <TileEngine E>
void flash_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                   int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start) {
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t ldq = nH * hd, ldk = nKV * hd;
  const int64_t nblk = (T + kBlock<E> - 1) / kBlock<E>;
  const int64_t rows = rep * kBlock<E>;  // stacked query rows of a block
#pragma omp parallel
  {
    std::vector<float> qs(rows * hd), s(rows * kBlock<E>), o(rows * hd), m(rows), l(rows);
    // Largest blocks first (the last query blocks see the most keys) for dynamic load balance.
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kh = 0; kh < nKV; ++kh)
        for (int64_t ib = nblk - 1; ib >= 0; --ib) {
          const int64_t i0 = ib * kBlock<E>, br = std::min(kBlock<E>, T - i0), R = rep * br;
          stack_group_rows(qs.data(), q, b, T, i0, br, kh, rep, ldq, hd);
          std::fill_n(m.begin(), R, -INFINITY);
          std::fill_n(l.begin(), R, 0.0f);
          std::fill_n(o.begin(), R * hd, 0.0f);
          const int64_t first = attention_key_start(doc_start, b, T, i0) / kBlock<E> * kBlock<E>;
          for (int64_t j0 = first; j0 <= i0; j0 += kBlock<E>) {
            const int64_t bc = std::min(kBlock<E>, T - j0);
            const float* kj = k + (b * T + j0) * ldk + kh * hd;
            const float* vj = v + (b * T + j0) * ldk + kh * hd;
            tile_gemm<E>(false, true, R, bc, hd, scale, qs.data(), hd, kj, ldk, 0.0f, s.data(), bc);
            for (int64_t rr = 0; rr < R; ++rr) {
              const int64_t r = rr % br;  // query position i0 + r
              float* row = s.data() + rr * bc;
              const int64_t nv = std::min(bc, i0 + r - j0 + 1);  // keys j <= i on this row
              // keys j >= the document's start
              const int64_t lo = std::max<int64_t>(0, attention_key_start(doc_start, b, T, i0 + r) - j0);
              if (lo >= nv) {  // no key of this row's document in the tile
                std::fill(row, row + bc, 0.0f);
                continue;
              }
              const float mnew = std::max(m[rr], vec::max(row + lo, nv - lo));
              const float sum = vec::exp_scale(row + lo, row + lo, nv - lo, mnew, 1.0f);
              std::fill(row, row + lo, 0.0f);
              std::fill(row + nv, row + bc, 0.0f);
              const float c = std::exp(m[rr] - mnew);  // 0 on the first block (m = -inf)
              l[rr] = l[rr] * c + sum;
              m[rr] = mnew;
              if (c != 1.0f) {
                float* orow = o.data() + rr * hd;
#pragma omp simd
                for (int64_t d = 0; d < hd; ++d) orow[d] *= c;
              }
            }
            tile_gemm<E>(false, false, R, hd, bc, 1.0f, s.data(), bc, vj, ldk, 1.0f, o.data(), hd);
          }
          for (int64_t rr = 0; rr < R; ++rr) {
            const int64_t g = rr / br, r = rr % br, h = kh * rep + g;
            const float inv = 1.0f / l[rr];
            float* dst = out + (b * T + i0 + r) * ldq + h * hd;
            const float* orow = o.data() + rr * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) dst[d] = orow[d] * inv;
            lse[(b * nH + h) * T + i0 + r] = m[rr] + std::log(l[rr]);
          }
        }
  }
}

template <TileEngine E>
void flash_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                    const float* v, const float* out, const float* lse, int64_t B, int64_t T, int64_t nH,
                    int64_t nKV, int64_t hd, const int32_t* doc_start) {
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t ldq = nH * hd, ldk = nKV * hd;
  const int64_t rows = rep * kBlock<E>;
#pragma omp parallel
  {
    // Per task: the group's stacked Q and dO rows of every query block (block ib at ib * rep * kBlock rows),
    // D_i = dO_i . O_i in the same order, and one (rows x kBlock) tile each of P and dP.
    const int64_t nblk = (T + kBlock<E> - 1) / kBlock<E>;
    std::vector<float> qs(nblk * rows * hd), dos(nblk * rows * hd), D(nblk * rows);
    std::vector<float> p(rows * kBlock<E>), dp(rows * kBlock<E>);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kh = 0; kh < nKV; ++kh) {
        for (int64_t ib = 0; ib < nblk; ++ib) {
          const int64_t i0 = ib * kBlock<E>, br = std::min(kBlock<E>, T - i0);
          float* qb = qs.data() + ib * rows * hd;
          float* dob = dos.data() + ib * rows * hd;
          stack_group_rows(qb, q, b, T, i0, br, kh, rep, ldq, hd);
          stack_group_rows(dob, dout, b, T, i0, br, kh, rep, ldq, hd);
          row_dots(D.data() + ib * rows, out, dob, b, T, i0, br, kh, rep, ldq, hd);
        }
        for (int64_t j0 = 0; j0 < T; j0 += kBlock<E>) {
          const int64_t bc = std::min(kBlock<E>, T - j0);
          const float* kj = k + (b * T + j0) * ldk + kh * hd;
          const float* vj = v + (b * T + j0) * ldk + kh * hd;
          float* dkj = dk + (b * T + j0) * ldk + kh * hd;
          float* dvj = dv + (b * T + j0) * ldk + kh * hd;
          for (int64_t i0 = j0; i0 < T; i0 += kBlock<E>) {
            const int64_t ib = i0 / kBlock<E>, br = std::min(kBlock<E>, T - i0), R = rep * br;
            // Documents of the whole query block start after this key block: nothing to add.
            if (attention_key_start(doc_start, b, T, i0) >= j0 + bc) continue;
            const float* qi = qs.data() + ib * rows * hd;
            const float* doi = dos.data() + ib * rows * hd;
            const float* Di = D.data() + ib * rows;
            tile_gemm<E>(false, true, R, bc, hd, scale, qi, hd, kj, ldk, 0.0f, p.data(), bc);
            for (int64_t rr = 0; rr < R; ++rr) {
              const int64_t g = rr / br, r = rr % br;
              float* row = p.data() + rr * bc;
              const int64_t nv = std::max<int64_t>(0, std::min(bc, i0 + r - j0 + 1));
              const int64_t lo =
                  std::min(nv, std::max<int64_t>(0, attention_key_start(doc_start, b, T, i0 + r) - j0));
              vec::exp_scale(row + lo, row + lo, nv - lo, lse[(b * nH + kh * rep + g) * T + i0 + r], 1.0f);
              std::fill(row, row + lo, 0.0f);
              std::fill(row + nv, row + bc, 0.0f);
            }
            tile_backward<E>(p.data(), dp.data(), qi, doi, Di, kj, vj, dkj, dvj,
                             dq + (b * T + i0) * ldq + kh * rep * hd, R, br, bc, rep, hd, ldk, ldq, scale);
          }
        }
      }
  }
}

// ---- Ring attention blocks (context parallel) ------------------------------------------------------------
// The same tiles with every row placed by its position in the whole sequence (AttentionRingKernels): a score
// is masked (-inf, probability 0) where the key's position is after the query's or before its document's
// start. A rank's rows are two chunks of the sequence, so positions need not grow along a tile: a tile is
// skipped when its first-read key position (the smallest) is after every query's position in the block, or
// its last (the largest) before every query's document start.
struct RingTiles {
  std::vector<int32_t> kmin, kmax;  // per key block
  std::vector<int32_t> qmax;        // per query block
};

template <TileEngine E>
RingTiles ring_tiles(int64_t Tq, int64_t Tk, const int32_t* q_pos, const int32_t* k_pos) {
  constexpr int64_t bs = kBlock<E>;
  RingTiles t;
  for (int64_t j0 = 0; j0 < Tk; j0 += bs) {
    const int32_t* p = k_pos + j0;
    const int64_t n = std::min(bs, Tk - j0);
    t.kmin.push_back(*std::min_element(p, p + n));
    t.kmax.push_back(*std::max_element(p, p + n));
  }
  for (int64_t i0 = 0; i0 < Tq; i0 += bs)
    t.qmax.push_back(*std::max_element(q_pos + i0, q_pos + i0 + std::min(bs, Tq - i0)));
  return t;
}

// Whether query block [i0, i0 + br) of batch row b reads any key of key block jb.
inline bool ring_tile_live(const RingTiles& t, int64_t ib, int64_t jb, const int32_t* key_start, int64_t b,
                           int64_t Tq, int64_t i0, int64_t br) {
  if (t.kmin[jb] > t.qmax[ib]) return false;
  if (!key_start) return true;
  const int32_t* ks = key_start + b * Tq + i0;
  return t.kmax[jb] >= *std::min_element(ks, ks + br);
}

// Scores of query row i (position qp, document start ks) against keys [j0, j0 + bc): the masked ones -inf.
// Returns whether any is read.
inline bool ring_mask_row(float* row, int64_t bc, const int32_t* k_pos, int64_t j0, int32_t qp, int32_t ks) {
  bool any = false;
  for (int64_t c = 0; c < bc; ++c) {
    const int32_t kp = k_pos[j0 + c];
    if (kp > qp || kp < ks)
      row[c] = -INFINITY;
    else
      any = true;
  }
  return any;
}

template <TileEngine E>
void ring_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                  int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos,
                  const int32_t* k_pos, const int32_t* key_start) {
  constexpr int64_t bs = kBlock<E>;
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t ldq = nH * hd, ldk = nKV * hd;
  const int64_t nqb = (Tq + bs - 1) / bs, nkb = (Tk + bs - 1) / bs, rows = rep * bs;
  const RingTiles tiles = ring_tiles<E>(Tq, Tk, q_pos, k_pos);
#pragma omp parallel
  {
    std::vector<float> qs(rows * hd), s(rows * bs), o(rows * hd), m(rows), l(rows);
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kh = 0; kh < nKV; ++kh)
        for (int64_t ib = 0; ib < nqb; ++ib) {
          const int64_t i0 = ib * bs, br = std::min(bs, Tq - i0), R = rep * br;
          stack_group_rows(qs.data(), q, b, Tq, i0, br, kh, rep, ldq, hd);
          std::fill_n(m.begin(), R, -INFINITY);
          std::fill_n(l.begin(), R, 0.0f);
          std::fill_n(o.begin(), R * hd, 0.0f);
          for (int64_t jb = 0; jb < nkb; ++jb) {
            if (!ring_tile_live(tiles, ib, jb, key_start, b, Tq, i0, br)) continue;
            const int64_t j0 = jb * bs, bc = std::min(bs, Tk - j0);
            const float* kj = k + (b * Tk + j0) * ldk + kh * hd;
            const float* vj = v + (b * Tk + j0) * ldk + kh * hd;
            tile_gemm<E>(false, true, R, bc, hd, scale, qs.data(), hd, kj, ldk, 0.0f, s.data(), bc);
            for (int64_t rr = 0; rr < R; ++rr) {
              const int64_t i = i0 + rr % br;
              float* row = s.data() + rr * bc;
              const int32_t ks = key_start ? key_start[b * Tq + i] : INT32_MIN;
              if (!ring_mask_row(row, bc, k_pos, j0, q_pos[i], ks)) {
                std::fill(row, row + bc, 0.0f);
                continue;
              }
              const float mnew = std::max(m[rr], vec::max(row, bc));
              const float sum = vec::exp_scale(row, row, bc, mnew, 1.0f);  // exp(-inf) = 0 where masked
              const float c = std::exp(m[rr] - mnew);
              l[rr] = l[rr] * c + sum;
              m[rr] = mnew;
              if (c != 1.0f) {
                float* orow = o.data() + rr * hd;
#pragma omp simd
                for (int64_t d = 0; d < hd; ++d) orow[d] *= c;
              }
            }
            tile_gemm<E>(false, false, R, hd, bc, 1.0f, s.data(), bc, vj, ldk, 1.0f, o.data(), hd);
          }
          for (int64_t rr = 0; rr < R; ++rr) {
            const int64_t g = rr / br, r = rr % br, h = kh * rep + g;
            const float inv = l[rr] > 0 ? 1.0f / l[rr] : 0.0f;
            float* dst = out + (b * Tq + i0 + r) * ldq + h * hd;
            const float* orow = o.data() + rr * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) dst[d] = orow[d] * inv;
            lse[(b * nH + h) * Tq + i0 + r] = l[rr] > 0 ? m[rr] + std::log(l[rr]) : -INFINITY;
          }
        }
  }
}

void ring_merge(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B, int64_t T,
                int64_t nH, int64_t hd) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nH; ++h) {
        float& l = lse[(b * nH + h) * T + t];
        const float p = part_lse[(b * nH + h) * T + t];
        if (p == -INFINITY) continue;
        const float mx = std::max(l, p);
        const float merged = mx + std::log1p(std::exp(std::min(l, p) - mx));
        const float ca = std::exp(l - merged), cp = std::exp(p - merged);
        float* o = out + ((b * T + t) * nH + h) * hd;
        const float* po = part_out + ((b * T + t) * nH + h) * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) o[d] = ca * o[d] + cp * po[d];
        l = merged;
      }
}

template <TileEngine E>
void ring_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                   const float* v, const float* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,
                   int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos, const int32_t* k_pos,
                   const int32_t* key_start) {
  constexpr int64_t bs = kBlock<E>;
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t ldq = nH * hd, ldk = nKV * hd, rows = rep * bs;
  const int64_t nqb = (Tq + bs - 1) / bs, nkb = (Tk + bs - 1) / bs;
  const RingTiles tiles = ring_tiles<E>(Tq, Tk, q_pos, k_pos);
#pragma omp parallel
  {
    std::vector<float> qs(nqb * rows * hd), dos(nqb * rows * hd), D(nqb * rows);
    std::vector<float> p(rows * bs), dp(rows * bs);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kh = 0; kh < nKV; ++kh) {
        for (int64_t ib = 0; ib < nqb; ++ib) {
          const int64_t i0 = ib * bs, br = std::min(bs, Tq - i0);
          float* qb = qs.data() + ib * rows * hd;
          float* dob = dos.data() + ib * rows * hd;
          stack_group_rows(qb, q, b, Tq, i0, br, kh, rep, ldq, hd);
          stack_group_rows(dob, dout, b, Tq, i0, br, kh, rep, ldq, hd);
          row_dots(D.data() + ib * rows, out, dob, b, Tq, i0, br, kh, rep, ldq, hd);
        }
        for (int64_t jb = 0; jb < nkb; ++jb) {
          const int64_t j0 = jb * bs, bc = std::min(bs, Tk - j0);
          const float* kj = k + (b * Tk + j0) * ldk + kh * hd;
          const float* vj = v + (b * Tk + j0) * ldk + kh * hd;
          float* dkj = dk + (b * Tk + j0) * ldk + kh * hd;
          float* dvj = dv + (b * Tk + j0) * ldk + kh * hd;
          for (int64_t ib = 0; ib < nqb; ++ib) {
            const int64_t i0 = ib * bs, br = std::min(bs, Tq - i0), R = rep * br;
            if (!ring_tile_live(tiles, ib, jb, key_start, b, Tq, i0, br)) continue;
            const float* qi = qs.data() + ib * rows * hd;
            const float* doi = dos.data() + ib * rows * hd;
            const float* Di = D.data() + ib * rows;
            tile_gemm<E>(false, true, R, bc, hd, scale, qi, hd, kj, ldk, 0.0f, p.data(), bc);
            for (int64_t rr = 0; rr < R; ++rr) {
              const int64_t g = rr / br, i = i0 + rr % br;
              float* row = p.data() + rr * bc;
              const int32_t ks = key_start ? key_start[b * Tq + i] : INT32_MIN;
              const float l = lse[(b * nH + kh * rep + g) * Tq + i];
              if (!ring_mask_row(row, bc, k_pos, j0, q_pos[i], ks) || l == -INFINITY)
                std::fill(row, row + bc, 0.0f);
              else
                vec::exp_scale(row, row, bc, l, 1.0f);
            }
            tile_backward<E>(p.data(), dp.data(), qi, doi, Di, kj, vj, dkj, dvj,
                             dq + (b * Tq + i0) * ldq + kh * rep * hd, R, br, bc, rep, hd, ldk, ldq, scale);
          }
        }
      }
  }
}

const AttentionKernels kFlash{flash_forward<TileEngine::kBlas>, flash_backward<TileEngine::kBlas>,
                              flash_saved_floats};
// Measured faster than "blas" at every shape tried (bench_attention, bench/BENCHMARKS.md).
TITAN_REGISTER_KERNEL(AttentionKernels, CPU, "flash", kFlash, 20);
// The default where built: as fast as "flash" on a well-detected OpenBLAS and 1.5-2x faster elsewhere.
#ifdef TITAN_HAVE_DNNL
const AttentionKernels kFlashOneDnn{flash_forward<TileEngine::kOneDnn>, flash_backward<TileEngine::kOneDnn>,
                                    flash_saved_floats};
TITAN_REGISTER_KERNEL(AttentionKernels, CPU, "flash_onednn", kFlashOneDnn, 25);
#endif
const AttentionRingKernels kRingFlash{ring_forward<TileEngine::kBlas>, ring_merge,
                                      ring_backward<TileEngine::kBlas>};
TITAN_REGISTER_KERNEL(AttentionRingKernels, CPU, "flash", kRingFlash, 20);
#ifdef TITAN_HAVE_DNNL
const AttentionRingKernels kRingFlashOneDnn{ring_forward<TileEngine::kOneDnn>, ring_merge,
                                            ring_backward<TileEngine::kOneDnn>};
TITAN_REGISTER_KERNEL(AttentionRingKernels, CPU, "flash_onednn", kRingFlashOneDnn, 25);
#endif

}  // namespace
}  // namespace titan
