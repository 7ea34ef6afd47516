// Training-checkpoint save and load speed: the full training state of a flavor (f32 parameters and
// both AdamW moments) through src/checkpoint, on however many ranks it is started with (under
// `mpirun -np N` the state is FSDP-sharded and every rank writes and reads its shard in parallel).
//   bench_checkpoint_io [--flavor 0.6B] [--dir DIR] [--rounds 3]
// Save time includes fsync and the checksum; "cold" loads first drop the files from the page cache
// (posix_fadvise DONTNEED on the fsynced files), "warm" loads read them from it. Checksums are verified
// on every load.
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/runtime.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/checkpointing.h"
#include "train/plan_streamer.h"

namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void drop_from_page_cache(const std::string& dir) {
  for (auto& e : fs::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string flavor = "0.6B", dir = "/tmp/titan-bench-checkpoint";
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--flavor")
      flavor = argv[i + 1];
    else if (k == "--dir")
      dir = argv[i + 1];
    else if (k == "--rounds")
      rounds = std::atoi(argv[i + 1]);
  }
  titan::dist::ProcessGroup& pg = titan::dist::init();
  const int threads = omp_get_max_threads();
  const bool lead = pg.rank() == 0;
  titan::Qwen3Model model(titan::Qwen3Config::flavor(flavor));
  model.init_weights(0);
  // As the trainer does: several ranks shard and stream the parameters (ZeRO-3 memory).
  titan::dist::DataParallelPlan dp(pg, 1, pg.size(), model.flat_params(), model.flat_grads(),
                                   int64_t(25) << 20, pg.size() > 1);
  titan::PlanStreamer streamer(dp);
  if (dp.streams_params()) model.set_param_streamer(&streamer);
  titan::AdamW opt(dp.optimizer_params(), dp.optimizer_grads(), titan::AdamWConfig{});
  // Moments with non-trivial contents (the parameters), as after some training.
  for (size_t g = 0; g < opt.exp_avg().size(); ++g) {
    opt.exp_avg()[g].copy_from(dp.optimizer_params()[g]);
    opt.exp_avg_sq()[g].copy_from(dp.optimizer_params()[g]);
  }
  if (lead) {
    fs::remove_all(dir);
    std::printf("flavor %s: %lld parameters, %d rank(s), %d OpenMP threads per rank\n", flavor.c_str(),
                static_cast<long long>(model.num_params()), pg.size(), threads);
  }
  pg.barrier();

  std::vector<double> save_gbs, cold_gbs, warm_gbs;
  int64_t bytes = 0;
  for (int r = 1; r <= rounds; ++r) {
    titan::ckpt::SaveRequest req;
    req.folder = dir;
    req.step = r;
    req.slices = titan::training_slices(model, dp, opt, /*for_save=*/true);
    req.meta = {{"bench", true}};
    req.log = false;
    pg.barrier();
    double t0 = now_s();
    const std::string saved = titan::ckpt::save(pg, req);
    const double t_save = now_s() - t0;
    if (lead) titan::ckpt::prune(dir, 1);
    pg.barrier();
    bytes = 0;
    for (auto& e : fs::directory_iterator(saved))
      if (e.path().extension() == ".safetensors") bytes += static_cast<int64_t>(e.file_size());
    save_gbs.push_back(bytes / t_save / 1e9);

    for (int warm = 0; warm < 2; ++warm) {
      if (!warm && lead) drop_from_page_cache(saved);
      titan::ckpt::Reader reader(saved);
      std::vector<titan::ckpt::Slice> wanted = titan::training_slices(model, dp, opt, /*for_save=*/false);
      pg.barrier();
      t0 = now_s();
      reader.read(wanted);
      pg.barrier();
      const double t_load = now_s() - t0;
      (warm ? warm_gbs : cold_gbs).push_back(bytes / t_load / 1e9);
    }
    if (lead)
      std::printf("round %d: %.2f GiB  save %.2f GB/s  load cold %.2f GB/s  warm %.2f GB/s\n", r,
                  bytes / 1073741824.0, save_gbs.back(), cold_gbs.back(), warm_gbs.back());
  }
  if (lead) {
    std::printf("median over %d rounds: %.2f GiB, save %.2f GB/s, load cold %.2f GB/s, load warm %.2f GB/s\n",
                rounds, bytes / 1073741824.0, median(save_gbs), median(cold_gbs), median(warm_gbs));
    fs::remove_all(dir);
  }
  return titan::dist::finish_command("bench_checkpoint_io", 0);
}
