#pragma once
// The experts of the emulator: an FFN per (layer, logical expert) with fp32 weights generated
// deterministically from (layer, expert), token activations generated from (step, token, layer),
// and the forward pass. Pure functions: any rank regenerates any expert's weights or any token's
// activation bit for bit, which is what lets every rank verify every output it computes against
// a reference without a copy of the model and without an all-to-all.
//
// An expert is two tensors, as in vLLM's fused MoE:
//   gate_up  [2 * intermediate][hidden]   rows [0, I) the gate, rows [I, 2I) the up projection
//   down     [hidden][intermediate]
// and y = down · (silu(gate · x) ⊙ (up · x)).

#include <cstddef>
#include <cstdint>
#include <span>

namespace eplb::emu {

struct ExpertShape {
  int64_t hidden = 0;
  int64_t intermediate = 0;

  int64_t gate_up_floats() const { return 2 * intermediate * hidden; }
  int64_t down_floats() const { return hidden * intermediate; }
  int64_t gate_up_bytes() const { return gate_up_floats() * static_cast<int64_t>(sizeof(float)); }
  int64_t down_bytes() const { return down_floats() * static_cast<int64_t>(sizeof(float)); }
  int64_t expert_bytes() const { return gate_up_bytes() + down_bytes(); }
  // FLOPs of one token through one expert (multiply-adds count 2).
  int64_t flops_per_token() const { return 2 * 3 * hidden * intermediate; }
  void validate() const;  // InvalidArgument naming --hidden / --intermediate
};

enum class Tensor : int { kGateUp = 0, kDown = 1 };

// Fills `out` (gate_up_floats() or down_floats() values) with the weights of one tensor of
// logical expert `expert` of layer `layer`: values in [-1, 1) / sqrt(fan-in), from a hash of
// (layer, expert, tensor, index).
void generate_weights(const ExpertShape& shape, int64_t layer, int32_t expert, Tensor tensor,
                      std::span<float> out);

// The same into raw bytes (the runtime's arena), for runtime::fill_weights.
void generate_weights_bytes(const ExpertShape& shape, int64_t layer, int32_t expert, Tensor tensor,
                            std::span<std::byte> out);

// Token activation x [hidden] of global token `token` at `step` entering `layer`: values in
// [-1, 1) from a hash of (step, token, layer).
void generate_activation(int64_t hidden, int64_t step, int64_t token, int64_t layer,
                         std::span<float> out);

// y [hidden] = expert(x). `scratch` holds 2 * intermediate floats. Always the same code path,
// so the same weights and input give the same bits on every rank.
void expert_forward(const ExpertShape& shape, const float* gate_up, const float* down,
                    const float* x, float* scratch, float* y);

}  // namespace eplb::emu
