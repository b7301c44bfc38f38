// read_file and write_file (eplb/core/file.h): POSIX open, read and write, retried on EINTR.
#include "eplb/core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "eplb/core/error.h"

namespace eplb {

std::string read_file(const std::string& path) {
  // A device is refused before it is opened (opening some has effects of its own).
  const auto refuse = [&](const struct stat& st) {
    const char* refused = S_ISDIR(st.st_mode)   ? "a directory"
                          : S_ISCHR(st.st_mode) ? "a character device"
                          : S_ISBLK(st.st_mode) ? "a block device"
                                                : nullptr;
    if (refused != nullptr) {
      fail(path, " is ", refused, ", not a file (give a regular file, or a pipe of at most ",
           kMaxStreamBytes >> 30, " GiB)");
    }
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) refuse(st);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) fail<IoError>("cannot open ", path, ": ", std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } closer{fd};
  if (::fstat(fd, &st) != 0) fail<IoError>("cannot stat ", path, ": ", std::strerror(errno));
  refuse(st);
  // A pipe, FIFO or socket has no size to check first: read it up to a limit.
  const bool regular = S_ISREG(st.st_mode);
  std::string out;
  size_t got = 0;
  try {
    if (regular && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n > 0) {
        out.append(buf, static_cast<size_t>(n));
        got += static_cast<size_t>(n);
        if (!regular && got > static_cast<size_t>(kMaxStreamBytes)) {
          fail(path, " is a stream longer than ", kMaxStreamBytes >> 30,
               " GiB, the most eplb reads from a pipe (save it to a file, which may be of any "
               "size)");
        }
      } else if (n == 0) {
        break;
      } else if (errno != EINTR) {
        fail<IoError>("cannot read ", path, ": ", std::strerror(errno));
      }
    }
  } catch (const std::bad_alloc&) {
    fail<IoError>("out of memory reading ", path, " after ", got, " bytes",
                  regular ? eplb::detail::concat(" of ", st.st_size) : std::string());
  }
  return out;
}

void write_file(const std::string& path, std::string_view text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail<IoError>("cannot write ", path, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail<IoError>("cannot write ", path, ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) fail<IoError>("cannot write ", path, ": ", std::strerror(errno));
}

}  // namespace eplb
