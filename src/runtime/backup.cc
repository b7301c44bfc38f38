#include "runtime/backup.h"

#include <algorithm>

#include "eplb/core/error.h"
#include "eplb/core/memory.h"

namespace eplb::runtime {

BackupLayout::BackupLayout(const Layout& layout, const WeightSpec& spec, int64_t copies)
    : copies_(copies),
      ranks_(layout.ranks),
      experts_(layout.experts),
      layers_(spec.layers),
      expert_bytes_(spec.expert_bytes()),
      experts_of_(static_cast<size_t>(layout.ranks)) {
  EPLB_CHECK(copies >= 0 && copies <= layout.ranks, "backup copies ", copies,
             " is outside [0, ", layout.ranks, "] (at most one copy of an expert per rank)");
  const int64_t per_node = layout.ranks / layout.nodes;
  stride_ = layout.nodes >= copies && layout.nodes > 1 ? per_node : 1;
  int64_t offset = 0;
  for (const TensorSpec& t : spec.tensors) {
    tensor_offset_.push_back(offset);
    offset += t.expert_bytes;
  }
  for (int32_t e = 0; e < experts_; ++e) {
    for (const int32_t seat : holders(e)) experts_of_[seat].push_back(e);
  }
  for (std::vector<int32_t>& share : experts_of_) std::sort(share.begin(), share.end());
  for (int64_t g = 0; g < ranks_; ++g) {
    checked_mul(checked_mul(static_cast<int64_t>(experts_of_[g].size()), layers_,
                            "backup experts of a rank"),
                expert_bytes_, "the bytes of a rank's backup copy");
  }
}

std::vector<int32_t> BackupLayout::holders(int32_t expert) const {
  std::vector<int32_t> seats;
  for (int64_t c = 0; c < copies_; ++c) {
    seats.push_back(static_cast<int32_t>((expert + c * stride_) % ranks_));
  }
  return seats;
}

int64_t BackupLayout::index(int seat, int32_t expert) const {
  const std::vector<int32_t>& share = experts_of_[seat];
  const auto it = std::lower_bound(share.begin(), share.end(), expert);
  return it != share.end() && *it == expert ? it - share.begin() : -1;
}

int64_t BackupLayout::bytes(int seat) const {
  if (copies_ == 0) return 0;
  return static_cast<int64_t>(experts_of_[seat].size()) * layers_ * expert_bytes_;
}

int64_t BackupLayout::offset(int seat, int64_t layer, int32_t expert, int64_t tensor) const {
  const int64_t i = index(seat, expert);
  EPLB_CHECK(i >= 0, "backup: seat ", seat, " keeps no copy of expert ", expert);
  const auto share = static_cast<int64_t>(experts_of_[seat].size());
  return (layer * share + i) * expert_bytes_ + tensor_offset_[tensor];
}

}  // namespace eplb::runtime
