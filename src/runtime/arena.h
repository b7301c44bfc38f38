#pragma once
// Where the expert weights of this rank live: one transport region of layers + 1 layer
// buffers, each [tensors][slots_per_rank][expert_bytes of the tensor]. Layer l lives in
// buffer_of_layer[l]; the remaining buffer is the staging buffer. Installing layer l
// swaps the two, so the staged content becomes live without a copy.
//
// The map starts as the identity (staging = layers) and changes only by install(), at the same
// steps on every rank, so it is the same on every rank at every step: a reader computes a
// peer's offsets from its own copy of the map.

#include <cstdint>
#include <utility>
#include <vector>

#include "eplb/runtime/rebalancer.h"

namespace eplb::runtime {

class ArenaLayout {
 public:
  ArenaLayout() = default;
  ArenaLayout(const WeightSpec& spec, int64_t slots_per_rank)
      : layers_(spec.layers), slots_per_rank_(slots_per_rank) {
    int64_t offset = 0;
    for (const TensorSpec& t : spec.tensors) {
      tensor_bytes_.push_back(t.expert_bytes);
      tensor_offset_.push_back(offset);
      offset += t.expert_bytes * slots_per_rank;
    }
    layer_bytes_ = offset;
  }

  int64_t tensors() const { return static_cast<int64_t>(tensor_bytes_.size()); }
  int64_t tensor_bytes(int64_t tensor) const { return tensor_bytes_[tensor]; }
  int64_t layer_bytes() const { return layer_bytes_; }
  int64_t buffers() const { return layers_ + 1; }
  int64_t total_bytes() const { return buffers() * layer_bytes_; }
  // Byte offset, in the region, of local slot `slot` of `tensor` in `buffer`.
  int64_t offset(int64_t buffer, int64_t tensor, int64_t slot) const {
    return buffer * layer_bytes_ + tensor_offset_[tensor] + slot * tensor_bytes_[tensor];
  }

 private:
  int64_t layers_ = 0;
  int64_t slots_per_rank_ = 0;
  int64_t layer_bytes_ = 0;
  std::vector<int64_t> tensor_bytes_;   // [tensors]
  std::vector<int64_t> tensor_offset_;  // [tensors] within a layer buffer
};

// The engine's own tensors on this rank (WeightSpec::engine), [layers][tensors], as the
// transport serves them: one registered region each, in the same order and so with the same
// region ids on every rank (connect() checks), and the same strides (the fingerprint does).
// Slot j of a tensor is at base + j * stride, here and, at that offset of the same region, on
// every peer. With them the arena is the staging layer alone (buffer 0, BufferMap of no layer).
struct EngineTensors {
  struct Tensor {
    int region = -1;
    std::byte* base = nullptr;
    int64_t stride = 0;
  };
  int64_t tensors = 0;
  std::vector<Tensor> at;  // [layers][tensors]

  const Tensor& of(int64_t layer, int64_t tensor) const {
    return at[static_cast<size_t>(layer * tensors + tensor)];
  }
};

struct BufferMap {
  std::vector<int32_t> buffer_of_layer;  // [layers]
  int32_t staging = 0;

  explicit BufferMap(int64_t layers = 0) : buffer_of_layer(static_cast<size_t>(layers)) {
    for (int64_t l = 0; l < layers; ++l) buffer_of_layer[l] = static_cast<int32_t>(l);
    staging = static_cast<int32_t>(layers);
  }
  void install(int64_t layer) { std::swap(buffer_of_layer[layer], staging); }
};

}  // namespace eplb::runtime
