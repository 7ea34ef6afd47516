// titan forward --model DIR --input in.json --output out.safetensors [--grads] [--steps K --lr X
//               --weight-decay W --max-norm M] [--dtype f32|bf16] [--kernel op=impl ...]
//               [--lora ADAPTER_DIR [--lora-bf16-base]]
#include <CLI/CLI.hpp>

#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "train/forward_tool.h"

namespace {

int forward_main(int argc, char** argv) {
  titan::ForwardToolOptions o;
  std::string dtype = "f32", device = "cpu";
  std::vector<std::string> kernels;
  CLI::App app{"Logits, loss, gradients and AdamW steps of an HF Qwen3 model on a batch, as safetensors",
               "titan forward"};
  app.add_option("--model", o.model_dir, "HF model directory (config.json + safetensors)")->required();
  app.add_option("--input", o.input_path, "JSON {\"input_ids\": [[...]], \"labels\": [[...]]}")->required();
  app.add_option("--output", o.output_path, "output .safetensors")->required();
  app.add_flag("--grads", o.grads, "also write grad.<HF name> for every parameter");
  app.add_option("--steps", o.steps, "AdamW steps on the batch (writes losses and param.<HF name>)");
  app.add_option("--lr", o.lr, "learning rate")->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  app.add_option("--beta1", o.beta1)->capture_default_str();
  app.add_option("--beta2", o.beta2)->capture_default_str();
  app.add_option("--eps", o.eps)->capture_default_str();
  app.add_option("--max-norm", o.max_norm, "clip gradients to this global norm (0: off)");
  app.add_option("--dtype", dtype, "compute dtype: f32 or bf16")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda, cuda:N or guard")->capture_default_str();
  app.add_option("--lora", o.lora_dir,
                 "PEFT LoRA adapter dir: frozen base, grads/params/steps of the adapter tensors only");
  app.add_flag("--lora-bf16-base", o.lora_bf16_base, "with --lora: hold the frozen base weights in bf16");
  app.add_option("--kernel", kernels, "kernel override op=impl (e.g. attention=reference)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  o.dtype = titan::parse_dtype(dtype);
  o.device = titan::parse_device(device, "--device");
  for (auto& k : kernels) {
    auto eq = k.find('=');
    TITAN_CHECK(eq != std::string::npos, "--kernel expects op=impl, got '", k, "'");
    o.kernels[k.substr(0, eq)] = k.substr(eq + 1);
  }
  titan::run_forward_tool(o);
  return 0;
}

}  // namespace

TITAN_COMMAND("forward", "logits / loss / gradients / AdamW steps of a model on given ids", forward_main);
