// gloo with its RedisStore rendezvous, against a redis-server started for the test.
#include <gtest/gtest.h>

#include "eplb/config.h"

#if EPLB_HAVE_GLOO
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "control/checks.h"
#include "control/harness.h"

namespace eplb::control::testing {
namespace {

std::string find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream folders(path ? path : "");
  std::string folder;
  while (std::getline(folders, folder, ':')) {
    const auto candidate = std::filesystem::path(folder) / program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return {};
}

// A loopback port nobody listens on right now.
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  close(fd);
  return ntohs(addr.sin_port);
}

bool accepts_connections(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

TEST(ControlGlooRedis, ConformanceThroughRedisStore) {
  const std::string server = find_on_path("redis-server");
  if (server.empty()) GTEST_SKIP() << "redis-server is not on PATH (apt-get install redis-server)";
  const int port = free_port();
  const std::string port_text = std::to_string(port);
  const pid_t redis = fork();
  if (redis == 0) {
    execl(server.c_str(), server.c_str(), "--port", port_text.c_str(), "--bind", "127.0.0.1",
          "--save", "", "--appendonly", "no", "--loglevel", "warning", nullptr);
    _exit(127);
  }
  ASSERT_GT(redis, 0);
  bool up = false;
  for (int i = 0; i < 2000 && !up; ++i) {
    up = accepts_connections(port);
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (up) {
    const int size = 4;
    Group group("gloo", size);
    group.rendezvous = "redis://127.0.0.1:" + port_text;
    const auto exits = run_group(group, [&](Communicator& comm) {
      check_everything(comm, "gloo", size);
      return 0;
    });
    for (const auto& exit : exits) EXPECT_TRUE(exit.ok()) << describe(exits);
  }
  kill(redis, SIGKILL);
  waitpid(redis, nullptr, 0);
  ASSERT_TRUE(up) << "redis-server on port " << port << " did not start";
}

TEST(ControlGlooRedis, BadAddressIsInvalidArgument) {
  Options options;
  options.rendezvous = "redis://127.0.0.1:notaport";
  EXPECT_THROW(connect("gloo", options), InvalidArgument);
}

}  // namespace
}  // namespace eplb::control::testing
#endif
