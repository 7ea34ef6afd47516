#include "distributed/pipeline_layout.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"

namespace titan::dist {

namespace {
constexpr const char* kKey = "parallelism.pipeline_parallel_";
}  // namespace

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "GPipe") return PipelineSchedule::kGPipe;
  if (name == "1F1B") return PipelineSchedule::k1F1B;
  if (name == "Interleaved1F1B") return PipelineSchedule::kInterleaved1F1B;
  fail(kKey, "schedule = '", name, "' is not one of GPipe, 1F1B, Interleaved1F1B");
}

const char* pipeline_schedule_name(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::kGPipe:
      return "GPipe";
    case PipelineSchedule::k1F1B:
      return "1F1B";
    case PipelineSchedule::kInterleaved1F1B:
      return "Interleaved1F1B";
  }
  return "?";
}

std::vector<int64_t> PipelineLayout::stages_of(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < static_cast<int64_t>(stages.size()); ++s)
    if (stages[s].rank == rank) out.push_back(s);
  return out;
}

std::vector<PipelineAction> pipeline_actions(const PipelineLayout& layout, int64_t rank) {
  const int64_t p = layout.degree, m = layout.microbatches;
  const std::vector<int64_t> mine = layout.stages_of(rank);
  const int64_t v = static_cast<int64_t>(mine.size());
  std::vector<PipelineAction> out;
  if (layout.schedule == PipelineSchedule::kGPipe) {
    for (int64_t i = 0; i < m; ++i) out.push_back({true, mine[0], i});
    for (int64_t i = m - 1; i >= 0; --i) out.push_back({false, mine[0], i});
    return out;
  }
  // k-th forward / backward of this rank: micro-batches in rounds of p, each round through the rank's
  // stages in order (forward) or in reverse (backward). With v = 1 this is plain 1F1B.
  const int64_t total = m * v;
  auto nth = [&](int64_t k, bool forward) {
    const int64_t round = k / (p * v), in_round = k % (p * v), chunk = in_round / p;
    const int64_t micro = v == 1 ? k : round * p + in_round % p;
    return PipelineAction{forward, mine[forward ? chunk : v - 1 - chunk], micro};
  };
  const int64_t warmup = std::min(total, v == 1 ? p - 1 - rank : 2 * (p - 1 - rank) + (v - 1) * p);
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(nth(f, true));
  while (f < total) {
    out.push_back(nth(f++, true));
    out.push_back(nth(b++, false));
  }
  while (b < total) out.push_back(nth(b++, false));
  return out;
}

double PipelineLayout::bubble_fraction() const {
  const double p = (double)degree, m = (double)microbatches, v = (double)stages_per_rank();
  return (p - 1) / (v * m + p - 1);
}

double PipelineLayout::peak_inflight(int64_t rank) const {
  const int64_t p = degree, m = microbatches, v = stages_per_rank();
  if (p == 1) return 1.0;  // no pipeline: the whole local batch in one forward
  switch (schedule) {
    case PipelineSchedule::kGPipe:
      return (double)m;
    case PipelineSchedule::k1F1B:
      return (double)std::min(m, p - rank);
    case PipelineSchedule::kInterleaved1F1B:
      return (double)std::min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1) / (double)v;
  }
  return (double)m;
}

std::string PipelineLayout::describe() const {
  std::ostringstream os;
  for (size_t s = 0; s < stages.size(); ++s) {
    const PipelineStage& st = stages[s];
    os << "  stage " << s << " (pipeline rank " << st.rank << "): ";
    if (st.embedding) os << "embedding + ";
    if (st.num_layers > 0)
      os << "layers " << st.first_layer << "-" << st.first_layer + st.num_layers - 1;
    else
      os << "no layers";
    if (st.head) os << " + norm + lm_head";
    if (s + 1 < stages.size()) os << "\n";
  }
  return os.str();
}

PipelineLayout make_pipeline_layout(int64_t num_layers, int64_t local_batch, const PipelineOptions& o) {
  PipelineLayout lay;
  const int64_t p = lay.degree = o.degree;
  TITAN_CHECK(p >= 1, kKey, "degree must be >= 1, got ", p);
  lay.schedule = parse_pipeline_schedule(o.schedule);
  TITAN_CHECK(o.microbatch_size >= 1, kKey, "microbatch_size must be >= 1, got ", o.microbatch_size);
  TITAN_CHECK(o.layers_per_stage >= 0, kKey, "layers_per_stage must be >= 0 (0: automatic), got ",
              o.layers_per_stage);
  TITAN_CHECK(o.first_stage_less_layers >= 0 && o.last_stage_less_layers >= 0, kKey,
              "first_stage_less_layers and ", kKey, "last_stage_less_layers must be >= 0, got ",
              o.first_stage_less_layers, " and ", o.last_stage_less_layers);
  if (p == 1) {  // no pipeline: one stage with everything, the local batch in one forward
    lay.microbatch_size = local_batch;
    lay.stages.push_back({0, num_layers, true, true, 0});
    return lay;
  }
  TITAN_CHECK(local_batch % o.microbatch_size == 0, "training.local_batch_size = ", local_batch,
              " is not a multiple of ", kKey, "microbatch_size = ", o.microbatch_size);
  lay.microbatch_size = o.microbatch_size;
  lay.microbatches = local_batch / o.microbatch_size;
  const bool looped = lay.schedule == PipelineSchedule::kInterleaved1F1B;
  if (looped)
    TITAN_CHECK(lay.microbatches % p == 0, kKey,
                "schedule = Interleaved1F1B runs micro-batches in rounds of ", kKey, "degree = ", p,
                ": training.local_batch_size / ", kKey, "microbatch_size = ", local_batch, " / ",
                o.microbatch_size, " = ", lay.microbatches, " is not a multiple of ", p);
  const int64_t first = o.first_stage_less_layers, last = o.last_stage_less_layers;
  const int64_t effective = num_layers + first + last;
  int64_t num_stages = p * (looped ? 2 : 1);
  if (o.layers_per_stage > 0) {
    num_stages = (effective + o.layers_per_stage - 1) / o.layers_per_stage;
    TITAN_CHECK(num_stages % p == 0, kKey, "layers_per_stage = ", o.layers_per_stage, " gives ", num_stages,
                " stages for model num_hidden_layers = ", num_layers, " (+ ", first, " + ", last,
                " for the embedding and the head), not a multiple of ", kKey, "degree = ", p);
    const int64_t v = num_stages / p;
    TITAN_CHECK(looped || v == 1, kKey, "layers_per_stage = ", o.layers_per_stage, " gives ", v,
                " stages per rank, but ", kKey, "schedule = ", o.schedule,
                " runs one stage per rank (Interleaved1F1B runs several)");
    TITAN_CHECK(!looped || v >= 2, kKey, "layers_per_stage = ", o.layers_per_stage,
                " gives one stage per rank, but ", kKey,
                "schedule = Interleaved1F1B needs at least two (fewer layers per stage, or 1F1B)");
  }
  const int64_t base = effective / num_stages, extra = effective % num_stages;
  TITAN_CHECK(num_stages <= effective && base > 0, kKey, "degree = ", p, " x ", num_stages / p,
              " stages per rank = ", num_stages, " stages for model num_hidden_layers = ", num_layers, " (+ ",
              first, " + ", last, " for the embedding and the head: ", effective,
              " effective layers): more stages than layers");
  TITAN_CHECK(first <= base && last <= base, kKey, "first_stage_less_layers = ", first, " and ", kKey,
              "last_stage_less_layers = ", last, " must not exceed the ", base, " layers a stage gets (",
              effective, " effective layers over ", num_stages, " stages)");
  int64_t layer = 0;
  for (int64_t s = 0; s < num_stages; ++s) {
    PipelineStage st;
    st.embedding = s == 0;
    st.head = s == num_stages - 1;
    st.rank = s % p;
    int64_t n = base + (s < extra ? 1 : 0) - (st.embedding ? first : 0) - (st.head ? last : 0);
    n = std::min(std::max<int64_t>(n, 0), num_layers - layer);
    st.first_layer = layer;
    st.num_layers = n;
    layer += n;
    lay.stages.push_back(st);
  }
  return lay;
}

}  // namespace titan::dist
