#include "transport/memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "eplb/core/error.h"

namespace eplb::transport {

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

std::size_t round_to_pages(std::size_t bytes) {
  return (bytes + page_size() - 1) / page_size() * page_size();
}

Segment::~Segment() {
  if (data != nullptr) ::munmap(data, mapped);
  if (fd >= 0) ::close(fd);
}

Segment create_segment(std::string_view backend, const char* name, std::size_t bytes) {
  Segment s;
  s.fd = ::memfd_create(name, MFD_CLOEXEC);
  if (s.fd < 0) fail<IoError>(backend, ": memfd_create failed: ", std::strerror(errno));
  s.bytes = bytes;
  s.mapped = round_to_pages(bytes);
  if (::ftruncate(s.fd, static_cast<off_t>(s.mapped)) != 0) {
    fail<IoError>(backend, ": cannot size a ", s.mapped, "-byte segment: ", std::strerror(errno));
  }
  struct stat st {};
  ::fstat(s.fd, &st);
  s.inode = st.st_ino;
  void* p = ::mmap(nullptr, s.mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, s.fd, 0);
  if (p == MAP_FAILED) {
    fail<IoError>(backend, ": cannot map ", s.mapped, " bytes of shared memory: ",
                  std::strerror(errno), " (is /dev/shm or the memory cgroup too small?)");
  }
  s.data = static_cast<std::byte*>(p);
  return s;
}

Segment map_peer_segment(std::string_view backend, int peer, std::int32_t pid, std::int32_t fd,
                         std::uint64_t inode, std::size_t bytes) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int local = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (local < 0) {
    fail<IoError>(backend, ": cannot open the memory of rank ", peer, " (", path, "): ",
                  std::strerror(errno), "; ", backend,
                  " needs every rank on this machine, running as the same user");
  }
  Segment s;
  s.fd = local;
  struct stat st {};
  ::fstat(local, &st);
  if (st.st_ino != inode || static_cast<std::size_t>(st.st_size) < bytes) {
    fail<IoError>(backend, ": the memory of rank ", peer, " is gone (its process closed or ",
                  "replaced the segment since exporting its descriptor)");
  }
  s.bytes = bytes;
  s.mapped = round_to_pages(bytes);
  void* p = ::mmap(nullptr, s.mapped, PROT_READ, MAP_SHARED | MAP_POPULATE, local, 0);
  if (p == MAP_FAILED) {
    fail<IoError>(backend, ": cannot map ", s.mapped, " bytes of rank ", peer, ": ",
                  std::strerror(errno));
  }
  s.data = static_cast<std::byte*>(p);
  ::close(local);
  s.fd = -1;
  return s;
}

}  // namespace eplb::transport
