// BPE trainer (work in progress).
#include "tokenizer/trainer.h"

#include "core/error.h"

namespace titan {
struct BpeTrainer::State {};
BpeTrainer::BpeTrainer() : state_(new State) {}
BpeTrainer::~BpeTrainer() { delete state_; }
void BpeTrainer::add_text(std::string_view) {}
std::string BpeTrainer::train(int, std::vector<std::string>) const { fail("tokenizer train: not implemented"); }
std::string train_bpe(const std::vector<std::string>&, int, std::vector<std::string>) {
  fail("tokenizer train: not implemented");
}
}  // namespace titan
