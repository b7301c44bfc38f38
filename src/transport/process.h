#pragma once
// Who owns a region, and whether that owner is still there.
//
// With shared memory a dead owner's pages stay mapped and readable, so a read cannot notice the
// death by itself. Descriptors therefore carry the owner's ProcessIdentity; an importer on the
// same machine opens a pidfd for it (which also sees an unreaped zombie as gone, and never
// mistakes a recycled pid for the owner), and a batch checks all its owners with one poll() when
// it completes: one syscall per batch, none per transfer.

#include <cstdint>
#include <span>
#include <string>

namespace eplb::transport {

struct ProcessIdentity {
  char boot_id[40] = {};         // the machine's boot id (kernel/random/boot_id)
  std::uint64_t pid_ns = 0;      // inode of the pid namespace
  std::int32_t pid = 0;
  std::uint64_t start_time = 0;  // in clock ticks after boot; tells a recycled pid apart

  static ProcessIdentity self();
  // Same machine and pid namespace: the pid means the same process here.
  bool same_machine_as(const ProcessIdentity& other) const;
  bool operator==(const ProcessIdentity& other) const;
};

// A watch on a peer process of this machine.
class PeerProcess {
 public:
  PeerProcess() = default;
  // IoError if the process is already gone.
  explicit PeerProcess(const ProcessIdentity& identity);
  PeerProcess(PeerProcess&& other) noexcept;
  PeerProcess& operator=(PeerProcess&& other) noexcept;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess();

  bool watching() const { return pidfd_ >= 0 || pid_ > 0; }
  bool alive() const;

 private:
  friend bool all_alive(std::span<const PeerProcess* const> peers);
  int pidfd_ = -1;
  std::int32_t pid_ = 0;            // when pidfds are unavailable: pid and start time
  std::uint64_t start_time_ = 0;
};

// One poll() over every watched peer; peers not watched count as alive.
bool all_alive(std::span<const PeerProcess* const> peers);

}  // namespace eplb::transport
