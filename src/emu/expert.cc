#include "emu/expert.h"

#include <cmath>
#include <cstring>

#include "eplb/core/hash.h"
#include "eplb/core/error.h"

namespace eplb::emu {
namespace {


// A uniform value in [-1, 1) from 24 bits of the hash: exact in fp32, the same everywhere.
float unit(uint64_t h) {
  return static_cast<float>(static_cast<int32_t>(h >> 40) - (1 << 23)) * (1.0f / (1 << 23));
}

// A dot product in eight interleaved partial sums, added in a fixed order: vectorizable without
// reassociating (no -ffast-math), and the same bits wherever it runs.
float dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) lane[j] += a[i] * b[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace

void ExpertShape::validate() const {
  if (hidden < 1 || hidden > (1 << 16)) fail("--hidden ", hidden, " must be in [1, 65536]");
  if (intermediate < 1 || intermediate > (1 << 16)) {
    fail("--intermediate ", intermediate, " must be in [1, 65536]");
  }
}

void generate_weights(const ExpertShape& shape, int64_t layer, int32_t expert, Tensor tensor,
                      std::span<float> out) {
  const bool gate_up = tensor == Tensor::kGateUp;
  const int64_t n = gate_up ? shape.gate_up_floats() : shape.down_floats();
  EPLB_CHECK_EQ(static_cast<int64_t>(out.size()), n, "weights of one expert tensor");
  const float scale =
      1.0f / std::sqrt(static_cast<float>(gate_up ? shape.hidden : shape.intermediate));
  const uint64_t seed = mix64((static_cast<uint64_t>(layer) << 40) ^
                            (static_cast<uint64_t>(static_cast<uint32_t>(expert)) << 8) ^
                            static_cast<uint64_t>(tensor) ^ 0x6A09E667F3BCC909ull);
  for (int64_t i = 0; i < n; ++i) {
    out[static_cast<size_t>(i)] = unit(mix64(seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull)) * scale;
  }
}

void generate_weights_bytes(const ExpertShape& shape, int64_t layer, int32_t expert, Tensor tensor,
                            std::span<std::byte> out) {
  EPLB_CHECK_EQ(out.size() % sizeof(float), size_t{0}, "weight bytes");
  // The arena is page-aligned by the transport and every tensor is a whole number of floats.
  generate_weights(shape, layer, expert, tensor,
                   {reinterpret_cast<float*>(out.data()), out.size() / sizeof(float)});
}

void generate_activation(int64_t hidden, int64_t step, int64_t token, int64_t layer,
                         std::span<float> out) {
  EPLB_CHECK_EQ(static_cast<int64_t>(out.size()), hidden, "activation");
  const uint64_t seed = mix64((static_cast<uint64_t>(step) << 32) ^ static_cast<uint64_t>(token) ^
                            (static_cast<uint64_t>(layer) << 56) ^ 0xBB67AE8584CAA73Bull);
  for (int64_t h = 0; h < hidden; ++h) {
    out[static_cast<size_t>(h)] = unit(mix64(seed + static_cast<uint64_t>(h) * 0x9E3779B97F4A7C15ull));
  }
}

void expert_forward(const ExpertShape& shape, const float* gate_up, const float* down,
                    const float* x, float* scratch, float* y) {
  const int64_t hidden = shape.hidden;
  const int64_t inter = shape.intermediate;
  // Step 1: gate and up projections, one dot product per row.
  for (int64_t r = 0; r < 2 * inter; ++r) scratch[r] = dot(gate_up + r * hidden, x, hidden);
  // Step 2: silu(gate) * up.
  for (int64_t i = 0; i < inter; ++i) {
    const float g = scratch[i];
    scratch[i] = g / (1.0f + std::exp(-g)) * scratch[inter + i];
  }
  // Step 3: down projection.
  for (int64_t h = 0; h < hidden; ++h) y[h] = dot(down + h * inter, scratch, inter);
}

}  // namespace eplb::emu
