// Tokenizer: loading and top-level encode/decode (work in progress).
#include "tokenizer/tokenizer.h"

#include "core/error.h"

namespace titan {

struct Tokenizer::Impl {};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) { fail("tokenizer: load not implemented yet: ", path); }
std::vector<int32_t> Tokenizer::encode(std::string_view, bool) const { fail("tokenizer: encode not implemented"); }
std::string Tokenizer::decode(std::span<const int32_t>, bool) const { fail("tokenizer: decode not implemented"); }
int32_t Tokenizer::vocab_size() const { return 0; }
std::optional<int32_t> Tokenizer::token_to_id(std::string_view) const { return std::nullopt; }
std::optional<int32_t> Tokenizer::eos_id() const { return std::nullopt; }

}  // namespace titan
