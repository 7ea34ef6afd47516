#include "train/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"

namespace titan {

MetricsLogger::MetricsLogger(const std::string& jsonl_path, int64_t total_steps, bool progress, bool print,
                             int64_t resumed_step, const std::string& tb_dir)
    : total_steps_(total_steps), progress_(progress && isatty(STDOUT_FILENO)), print_(print) {
  if (!tb_dir.empty()) tb_ = std::make_unique<tb::EventWriter>(tb_dir);
  if (!jsonl_path.empty()) {
    // A resumed run keeps the records up to its checkpoint's step and continues after them.
    std::string kept;
    if (resumed_step > 0) {
      std::ifstream in(jsonl_path);
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.value("step", int64_t(0)) <= resumed_step) kept += line + "\n";
      }
    }
    jsonl_ = std::fopen(jsonl_path.c_str(), "w");
    if (jsonl_ && !kept.empty()) std::fputs(kept.c_str(), jsonl_);
    TITAN_CHECK(jsonl_, jsonl_path, ": cannot open for writing");
  }
}

MetricsLogger::~MetricsLogger() {
  if (jsonl_) std::fclose(jsonl_);
}

void MetricsLogger::log(const StepMetrics& m) {
  elapsed_ += m.time_s;
  const bool validated = std::isfinite(m.val_loss);
  if (jsonl_) {
    std::fprintf(jsonl_,
                 "{\"step\": %lld, \"loss\": %.17g, \"grad_norm\": %.6f, \"lr\": %.8g, \"tokens\": %lld, "
                 "\"tps\": %.2f, "
                 "\"tflops\": %.4f, \"mfu\": %.3f, \"mem_gib\": %.4f, \"time_s\": %.4f",
                 (long long)m.step, m.loss, m.grad_norm, m.lr, (long long)m.tokens, m.tps, m.tflops, m.mfu,
                 m.mem_gib, m.time_s);
    if (validated) std::fprintf(jsonl_, ", \"val_loss\": %.17g, \"val_ppl\": %.17g", m.val_loss, m.val_ppl);
    std::fprintf(jsonl_, "}\n");
    std::fflush(jsonl_);
  }
  if (tb_) {  // torchtitan's tags
    std::vector<std::pair<std::string, float>> scalars = {{"loss_metrics/global_avg_loss", (float)m.loss},
                                                          {"grad_norm", (float)m.grad_norm},
                                                          {"lr", (float)m.lr},
                                                          {"throughput(tps)", (float)m.tps},
                                                          {"tflops", (float)m.tflops},
                                                          {"mfu(%)", (float)m.mfu},
                                                          {"memory/max_reserved(GiB)", (float)m.mem_gib},
                                                          {"memory/max_reserved(%)", (float)m.mem_pct},
                                                          {"time_metrics/end_to_end(s)", (float)m.time_s}};
    if (validated) {
      scalars.emplace_back("validation_metrics/loss", (float)m.val_loss);
      scalars.emplace_back("validation_metrics/perplexity", (float)m.val_ppl);
    }
    tb_->add_scalars(m.step, scalars);
  }
  if (!print_) return;
  if (progress_) std::printf("\r\033[K");
  std::printf(
      "step: %4lld  loss: %7.4f  grad_norm: %7.4f  lr: %.3e  memory: %.2fGiB(%.2f%%)  tps: %.0f  "
      "tflops: %.3f  mfu: %.2f%%",
      (long long)m.step, m.loss, m.grad_norm, m.lr, m.mem_gib, m.mem_pct, m.tps, m.tflops, m.mfu);
  if (validated) std::printf("  val_loss: %7.4f  val_ppl: %.2f", m.val_loss, m.val_ppl);
  std::printf("\n");
  if (progress_) draw_progress(m.step);
  std::fflush(stdout);
}

void MetricsLogger::draw_progress(int64_t step) const {
  const double frac = std::min(1.0, double(step) / double(total_steps_));
  const int width = 30, filled = static_cast<int>(frac * width);
  const double eta = step > 0 ? elapsed_ / step * (total_steps_ - step) : 0;
  std::printf("[%s%s] %3.0f%%  step %lld/%lld  ETA %dm%02ds", std::string(filled, '#').c_str(),
              std::string(width - filled, ' ').c_str(), frac * 100, (long long)step, (long long)total_steps_,
              static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
}

void MetricsLogger::finish() {
  if (progress_ && print_) std::printf("\r\033[K");
  std::fflush(stdout);
}

double measure_gemm_tflops(const MatmulKernels& engine, Device device) {
  const int n = 2048;
  const size_t nn = size_t(n) * n;
  // Operands on the engine's device (a GEMM of host buffers would be another device's work).
  Tensor a = Tensor::empty({n, n}, DType::F32, device), b = Tensor::empty({n, n}, DType::F32, device),
         c = Tensor::empty({n, n}, DType::F32, device);
  a.copy_from_host(std::vector<float>(nn, 0.5f).data());
  b.copy_from_host(std::vector<float>(nn, 0.25f).data());
  DeviceInterface& dev = device_interface(device.type);
  auto sync = [&] {
    if (dev.synchronize) dev.synchronize();
  };
  // As in a model under bf16 compute, the weight has a bf16 image (the CPU's bf16 engine reads it instead
  // of converting the weight at every call; f32 engines ignore it).
  std::vector<uint16_t> image;
  if (device.type == DeviceType::CPU) {
    image.assign(nn, f32_to_bf16(0.25f));
    register_bf16_image(b.f32(), static_cast<int64_t>(nn), image.data());
  }
  engine.forward(c.f32(), a.f32(), b.f32(), n, n, n);
  sync();
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    engine.forward(c.f32(), a.f32(), b.f32(), n, n, n);
    sync();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / dt / 1e12);
  }
  if (!image.empty()) unregister_bf16_image(b.f32());
  return best;
}

double cpu_theoretical_tflops(CpuIsa isa, bool bf16, int threads, std::string* how) {
  double mhz = 0;
  {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
    double khz = 0;
    if (f >> khz) mhz = khz / 1000.0;
  }
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.starts_with("cpu MHz")) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) mhz = std::max(mhz, std::atof(line.c_str() + colon + 1));
    }
  if (mhz <= 0) return 0;
  double per_cycle = 8;  // SSE: a 4-lane multiply and a 4-lane add per cycle
  const char* what = "f32 (baseline SSE)";
  if (bf16 && isa >= CpuIsa::kAmx) {
    per_cycle = 2048, what = "bf16 (AMX)";
  } else if (bf16 && isa >= CpuIsa::kAvx512Bf16) {
    per_cycle = 128, what = "bf16 (AVX512_BF16)";
  } else if (isa >= CpuIsa::kAvx512) {
    per_cycle = 64, what = "f32 (AVX-512)";
  } else if (isa >= CpuIsa::kAvx2) {
    per_cycle = 32, what = "f32 (AVX2 + FMA)";
  }
  if (how) *how = str_cat(threads, " cores x ", mhz / 1000.0, " GHz x ", per_cycle, " ", what, " FLOP/cycle");
  return threads * mhz * 1e6 * per_cycle / 1e12;
}

int64_t physical_memory_bytes() {
  return int64_t(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

namespace {

// The chart's frame: title, axes, loss grid lines and step ticks (x maps a loss index, y a loss).
template <class X, class Y>
void svg_frame(std::ostringstream& os, const std::string& title, double lo, double hi, size_t n, X x, Y y) {
  const double W = 720, H = 420, L = 60, R = 20, T = 40, B = 50;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << title
     << "</text>\n"
     << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B
     << "\" stroke=\"black\"/>\n"
     << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B
     << "\" stroke=\"black\"/>\n";
  for (int k = 0; k <= 4; ++k) {
    const double v = lo + (hi - lo) * k / 4.0;
    os << "<text x=\"" << L - 6 << "\" y=\"" << y(v) + 4 << "\" text-anchor=\"end\">"
       << std::round(v * 100) / 100 << "</text>\n<line x1=\"" << L << "\" y1=\"" << y(v) << "\" x2=\""
       << W - R << "\" y2=\"" << y(v) << "\" stroke=\"#ddd\"/>\n";
  }
  for (int k = 0; k <= 4; ++k) {
    const size_t i = (n - 1) * k / 4;
    os << "<text x=\"" << x(i) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">" << i + 1
       << "</text>\n";
  }
  os << "<text x=\"" << W / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>\n"
     << "<text x=\"16\" y=\"" << H / 2 << "\" transform=\"rotate(-90 16 " << H / 2
     << ")\" text-anchor=\"middle\">loss</text>\n";
}

}  // namespace

void write_loss_svg(const std::string& path, const std::vector<double>& losses, const std::string& title,
                    const std::vector<std::pair<int64_t, double>>& val) {
  const double W = 720, H = 420, L = 60, R = 20, T = 40, B = 50;
  std::vector<double> finite;
  for (double v : losses)
    if (std::isfinite(v)) finite.push_back(v);
  for (auto& [i, v] : val)
    if (std::isfinite(v)) finite.push_back(v);
  double lo = finite.empty() ? 0 : *std::min_element(finite.begin(), finite.end());
  double hi = finite.empty() ? 1 : *std::max_element(finite.begin(), finite.end());
  if (hi - lo < 1e-9) hi = lo + 1;
  const size_t n = std::max<size_t>(losses.size(), 2);
  auto x = [&](size_t i) { return L + (W - L - R) * double(i) / double(n - 1); };
  auto y = [&](double v) { return T + (H - T - B) * (1.0 - (v - lo) / (hi - lo)); };
  std::ostringstream os;
  svg_frame(os, title, lo, hi, n, x, y);
  os << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
  for (size_t i = 0; i < losses.size(); ++i)
    if (std::isfinite(losses[i])) os << x(i) << "," << y(losses[i]) << " ";
  os << "\"/>\n";
  if (!val.empty()) {  // validation: an orange line with a dot per evaluation, and a legend
    os << "<polyline fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"1.5\" points=\"";
    for (auto& [i, v] : val)
      if (std::isfinite(v)) os << x(size_t(i)) << "," << y(v) << " ";
    os << "\"/>\n";
    for (auto& [i, v] : val)
      if (std::isfinite(v))
        os << "<circle cx=\"" << x(size_t(i)) << "\" cy=\"" << y(v) << "\" r=\"3\" fill=\"#ff7f0e\"/>\n";
    os << "<text x=\"" << W - R - 4 << "\" y=\"" << T + 12 << "\" text-anchor=\"end\" fill=\"#1f77b4\">"
       << "training loss</text>\n<text x=\"" << W - R - 4 << "\" y=\"" << T + 28
       << "\" text-anchor=\"end\" fill=\"#ff7f0e\">validation loss</text>\n";
  }
  os << "</svg>\n";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    TITAN_CHECK(f, tmp, ": cannot open for writing");
    f << os.str();
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace titan
