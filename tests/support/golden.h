// Parameters after the AdamW steps of a golden fixture (tests/golden/qwen3*, made by
// tools/golden/make_qwen3*_golden.py), measured against HF's float32 result and a float64 truth.
//
// Adam's m / (sqrt(v) + eps) turns float32 round-off in a gradient element that cancels to ~1e-7
// into a visible update, so two correct float32 runs (HF's, ours; or ours under other compiler
// flags or another attention kernel) can differ per tensor by more than 1e-4. The fixtures also
// hold the same steps run by HF in float64 (expected_f64.safetensors). A tensor passes when it is
// within `tol` of HF's float32 parameters, or no farther from the float64 ones than 2x HF's own
// float32 distance to them. All parameters together must also be within 1e-5 of HF's float32, or
// no farther from the float64 ones than HF's float32 (a device whose reductions run in another order,
// such as the GPU's, lands elsewhere among the float32 results, and the float64 run judges it).
#pragma once
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "testing.h"
#include "train/forward_tool.h"

namespace titan::testing {

// The optimizer settings of a fixture's meta.json (lr, weight decay, clipping, betas, eps) into `o`.
inline void set_adamw_from_meta(ForwardToolOptions& o, const nlohmann::json& meta) {
  o.lr = meta["lr"].get<float>();
  o.weight_decay = meta["weight_decay"].get<float>();
  o.max_norm = meta["max_norm"].get<double>();
  o.beta1 = meta["betas"][0].get<float>();
  o.beta2 = meta["betas"][1].get<float>();
  o.eps = meta["eps"].get<float>();
}

class GoldenParams {
 public:
  explicit GoldenParams(const std::string& dir, double tol = 1e-4)
      : want_(dir + "/expected.safetensors"), want64_(dir + "/expected_f64.safetensors"), tol_(tol) {}

  const SafetensorsFile& want() const { return want_; }

  // Checks one `param.<name>` tensor and adds it to the all-parameter sum.
  void expect_close(const std::string& key, const Tensor& got, const std::string& label) {
    Tensor hf = want_.load(key);
    ASSERT_EQ(got.numel(), hf.numel()) << label << " " << key;
    const std::vector<double> truth = load_f64(key, hf.numel());
    double d_hf = 0, d_truth = 0, d_hf_truth = 0, n_truth = 0, n_hf = 0;
    for (int64_t i = 0; i < hf.numel(); ++i) {
      const double a = got.f32()[i], h = hf.f32()[i], t = truth[size_t(i)];
      d_hf += (a - h) * (a - h);
      d_truth += (a - t) * (a - t);
      d_hf_truth += (h - t) * (h - t);
      n_truth += t * t;
      n_hf += h * h;
    }
    sum_diff_ += d_hf;
    sum_ref_ += n_hf;
    sum_diff_truth_ += d_truth;
    sum_hf_truth_ += d_hf_truth;
    sum_truth_ += n_truth;
    const double rel_hf = n_hf > 0 ? std::sqrt(d_hf / n_hf) : std::sqrt(d_hf);
    const double rel_truth = n_truth > 0 ? std::sqrt(d_truth / n_truth) : std::sqrt(d_truth);
    const double hf_rel_truth = n_truth > 0 ? std::sqrt(d_hf_truth / n_truth) : std::sqrt(d_hf_truth);
    EXPECT_TRUE(rel_hf <= tol_ || rel_truth <= 2 * hf_rel_truth)
        << label << " " << key << ": " << rel_hf << " from HF float32 (tolerance " << tol_ << "), "
        << rel_truth << " from float64 where HF float32 is " << hf_rel_truth;
  }

  // All parameters together, after every expect_close.
  void expect_total_close(const std::string& label, double tol = 1e-5) const {
    EXPECT_GT(sum_ref_, 0.0) << label;
    EXPECT_GT(sum_truth_, 0.0) << label;
    const double rel_hf = std::sqrt(sum_diff_ / sum_ref_);
    const double rel_truth = std::sqrt(sum_diff_truth_ / sum_truth_);
    const double hf_rel_truth = std::sqrt(sum_hf_truth_ / sum_truth_);
    EXPECT_TRUE(rel_hf <= tol || rel_truth <= hf_rel_truth)
        << label << " parameters after the AdamW steps: " << rel_hf << " from HF float32 (tolerance " << tol
        << "), " << rel_truth << " from float64 where HF float32 is " << hf_rel_truth;
  }

 private:
  std::vector<double> load_f64(const std::string& key, int64_t numel) const {
    const SafetensorsEntry& e = want64_.entry(key);
    EXPECT_EQ(e.dtype, "F64") << want64_.path() << " " << key;
    std::vector<double> out(size_t(numel), 0.0);
    if (e.dtype == "F64" && e.end - e.begin == out.size() * sizeof(double))
      std::memcpy(out.data(), want64_.bytes(e), out.size() * sizeof(double));
    else
      ADD_FAILURE() << want64_.path() << ": " << key << " is not F64 with " << numel << " elements";
    return out;
  }

  SafetensorsFile want_, want64_;
  double tol_;
  double sum_diff_ = 0, sum_ref_ = 0;                             // against HF float32
  double sum_diff_truth_ = 0, sum_hf_truth_ = 0, sum_truth_ = 0;  // against the float64 run
};

}  // namespace titan::testing
