#pragma once
// Where the host copies of the experts live (Config::backup, docs/elastic.md): copy c of expert
// e (the same seat in every layer) is on seat (e + c * stride) mod ranks, stride the ranks of a
// node while there are at least as many nodes as copies (each copy on another node), else 1.
// Every rank computes the same table, so it knows at which offset of which peer's backup region
// any copy sits. A seat's share is [layers][its experts, ascending][tensors' bytes of one expert].

#include <cstdint>
#include <vector>

#include "eplb/core/types.h"
#include "eplb/runtime/rebalancer.h"

namespace eplb::runtime {

class BackupLayout {
 public:
  BackupLayout() = default;
  BackupLayout(const Layout& layout, const WeightSpec& spec, int64_t copies);

  int64_t copies() const { return copies_; }
  // The seats holding a copy of `expert`, [copies].
  std::vector<int32_t> holders(int32_t expert) const;
  // The experts `seat` keeps a copy of, ascending.
  const std::vector<int32_t>& experts_of(int seat) const { return experts_of_[seat]; }
  // Position of `expert` in `seat`'s share, or -1.
  int64_t index(int seat, int32_t expert) const;
  int64_t bytes(int seat) const;
  // Byte offset of (layer, expert, tensor) in `seat`'s backup region; the expert must be there.
  int64_t offset(int seat, int64_t layer, int32_t expert, int64_t tensor) const;

 private:
  int64_t copies_ = 0;
  int64_t ranks_ = 0;
  int64_t experts_ = 0;
  int64_t layers_ = 0;
  int64_t stride_ = 1;
  int64_t expert_bytes_ = 0;                // all tensors of one expert
  std::vector<int64_t> tensor_offset_;      // [tensors] within one expert's bytes
  std::vector<std::vector<int32_t>> experts_of_;  // [ranks]
};

}  // namespace eplb::runtime
