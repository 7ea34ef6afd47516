// The model side of a run: its shape (HF config.json or a flavor, with the config's overrides) and the
// check of the [kernels] choice against the registry.
#pragma once
#include <map>
#include <string>

#include "device/device.h"
#include "models/qwen3/config.h"
#include "train/config.h"

namespace titan {

// The model shape of a run: config.json of model.hf_assets_path when present, else model.flavor;
// model.vocab_size overrides the vocabulary.
Qwen3Config resolve_model_config(const TrainConfig& config);

// Every [kernels] entry names a registered op and one of its implementations (errors list the valid
// ones).
void validate_kernel_choice(const std::map<std::string, std::string>& kernels,
                            DeviceType device = DeviceType::CPU);
// The [kernels] choices that apply on `device`: a configuration's kernels name cpu implementations (the
// shipped configs pick e.g. rope = "fused"); on another device a choice that is a cpu implementation but
// not one of this device's gives way to the device's default, said in `notes`. Anything else must exist
// on the device (validate_kernel_choice's errors).
std::map<std::string, std::string> kernels_for_device(const std::map<std::string, std::string>& kernels,
                                                      DeviceType device, std::string* notes = nullptr);

}  // namespace titan
