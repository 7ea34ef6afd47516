// A .safetensors file from a model repository: the 8-byte header length, the JSON header (dtype,
// shape, data_offsets of each tensor, __metadata__), then every tensor read out as a weight load does.
#include "fuzz_target.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = titan::fuzz::write_scratch("model.safetensors", titan::fuzz::as_text(data, size));
  titan::fuzz::expect_clean_error(path, [&] {
    titan::SafetensorsFile file(path);
    for (const auto& [name, entry] : file.entries()) {
      titan::Tensor t = file.load(name);
      if (t.numel() > 0) {
        // The f32 copy a model's parameter gets (F16/BF16/F32 convert, integers are refused).
        titan::Tensor dst = titan::Tensor::zeros(entry.shape);
        file.read_into(name, dst);
      }
    }
  });
  return 0;
}
