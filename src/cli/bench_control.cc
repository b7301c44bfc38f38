// `eplb bench control`: all-reduce latency of the control plane, 4 int64 values, N ranks;
// `--ranks 8,32,64` measures each size in turn, one row (or JSON object) each.
//
// inproc ranks are threads; shm and gloo ranks are forked children of this process (gloo meets
// through a temporary folder); mpi ranks are mpirun's: run outside mpirun, the verb starts
// itself again under `mpirun -np N --oversubscribe` and that run prints the figures.
// Latency is measured on rank 0, one all-reduce at a time, after a warm-up.

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/option_checks.h"
#include "eplb/control/communicator.h"
#include "eplb/control/launch.h"
#include "eplb/core/error.h"

namespace eplb::cli {
namespace {

using control::Communicator;

struct Args {
  std::string backend = "shm";
  int ranks = 2;  // the size being measured: one of `sizes`
  std::vector<int> sizes = {2};
  std::string sizes_text = "2";  // --ranks as given: parse_int_list fills `sizes`
  int iters = 2000;
  bool json = false;
};

struct Figures {
  double p50_us = 0;
  double p99_us = 0;
};

Figures measure(Communicator& comm, int iters) {
  std::array<std::int64_t, 4> values{};
  const int warmup = std::max(10, iters / 10);
  for (int i = 0; i < warmup; ++i) comm.all_reduce(values, control::ReduceOp::kSum);
  comm.barrier();
  std::vector<double> samples;
  samples.reserve(iters);
  for (int i = 0; i < iters; ++i) {
    values = {comm.rank(), i, -i, 1};
    const auto start = control::Clock::now();
    comm.all_reduce(values, control::ReduceOp::kSum);
    const auto stop = control::Clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  comm.barrier();
  std::sort(samples.begin(), samples.end());
  const auto at = [&](double q) {
    const auto index = static_cast<std::size_t>(q * static_cast<double>(samples.size()));
    return samples[std::min(index, samples.size() - 1)];
  };
  return {at(0.50), at(0.99)};
}

control::Options options_for(const Args& args, int rank, const std::string& rendezvous) {
  control::Options options;
  options.rank = rank;
  options.size = args.ranks;
  options.rendezvous = rendezvous;
  if (args.backend == "gloo") options.hostname = "127.0.0.1";
  return options;
}

void print(const Args& args, const Figures& figures) {
  if (args.json) {
    nlohmann::json out = {{"backend", args.backend},
                          {"ranks", args.ranks},
                          {"p50_us", figures.p50_us},
                          {"p99_us", figures.p99_us}};
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("control all-reduce ({}, {} ranks, 4 x int64, {} iterations): p50 {:.1f} us, "
               "p99 {:.1f} us\n",
               args.backend, args.ranks, args.iters, figures.p50_us, figures.p99_us);
  }
  std::fflush(stdout);
}

Figures run_threads(const Args& args) {
  const std::string name = fmt::format("bench-control-{}", getpid());
  Figures figures;
  std::vector<std::exception_ptr> errors(args.ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < args.ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto comm = control::connect("inproc", options_for(args, rank, name));
        const auto mine = measure(*comm, args.iters);
        if (rank == 0) figures = mine;
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return figures;
}

Figures run_forked(const Args& args) {
  std::string rendezvous = fmt::format("bench-control-{}", getpid());
  std::optional<control::ScratchFolder> folder;
  if (args.backend == "gloo") {
    folder.emplace("eplb-bench-control");
    rendezvous = folder->path();
  }
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) fail<IoError>("pipe failed: ", std::strerror(errno));
  const auto exits = control::fork_ranks(args.ranks, [&](int rank) {
    close(pipe_fds[0]);
    auto comm = control::connect(args.backend, options_for(args, rank, rendezvous));
    const Figures figures = measure(*comm, args.iters);
    if (rank == 0 && ::write(pipe_fds[1], &figures, sizeof(figures)) != sizeof(figures)) {
      return 1;
    }
    return 0;
  });
  close(pipe_fds[1]);
  Figures figures;
  const auto got = ::read(pipe_fds[0], &figures, sizeof(figures));
  close(pipe_fds[0]);
  control::check_all_ok(exits);
  if (got != static_cast<ssize_t>(sizeof(figures))) fail<IoError>("rank 0 reported no figures");
  return figures;
}

std::string find_mpirun() {
  const char* path = std::getenv("PATH");
  std::string folders = path ? path : "";
  std::size_t start = 0;
  while (start <= folders.size()) {
    const auto end = std::min(folders.find(':', start), folders.size());
    const auto candidate = std::filesystem::path(folders.substr(start, end - start)) / "mpirun";
    if (access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  return {};
}

// Starts this verb again under mpirun and returns when it is done; its rank 0 prints.
void relaunch_under_mpirun(const Args& args) {
  const std::string mpirun = find_mpirun();
  if (mpirun.empty()) {
    fail<NotSupported>("--backend mpi needs mpirun on PATH (apt-get install openmpi-bin), or "
                       "run `mpirun -np N eplb bench control --backend mpi --ranks N`");
  }
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv = {mpirun, "-np", std::to_string(args.ranks), "--oversubscribe"};
  if (geteuid() == 0) argv.push_back("--allow-run-as-root");  // OpenMPI refuses root otherwise
  for (const std::string& arg :
       {self, std::string("bench"), std::string("control"), std::string("--backend"),
        std::string("mpi"), std::string("--ranks"), std::to_string(args.ranks),
        std::string("--iters"), std::to_string(args.iters)}) {
    argv.push_back(arg);
  }
  if (args.json) argv.push_back("--json");
  std::vector<char*> pointers;
  for (auto& arg : argv) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(mpirun.c_str(), pointers.data());
    _exit(127);
  }
  if (pid < 0) fail<IoError>("fork failed: ", std::strerror(errno));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fail<IoError>("mpirun -np ", args.ranks, " failed (",
                  WIFEXITED(status) ? fmt::format("exit code {}", WEXITSTATUS(status))
                                    : fmt::format("signal {}", WTERMSIG(status)),
                  ")");
  }
}

void run_one(const Args& args);

void run(const Args& args) {
  const auto names = control::backend_names();
  if (std::find(names.begin(), names.end(), args.backend) == names.end()) {
    std::string known;
    for (const auto& name : names) known += (known.empty() ? "" : ", ") + name;
    fail<InvalidArgument>("--backend ", args.backend, " is not built in (this build has: ",
                          known, ")");
  }
  if (args.sizes.empty()) fail<InvalidArgument>("--ranks needs at least one size");
  for (const int ranks : args.sizes) {
    if (ranks < 1 || ranks > control::max_local_ranks()) {
      fail<InvalidArgument>("--ranks ", ranks, " is outside [1, ", control::max_local_ranks(),
                            "] (ranks this machine takes, as processes or threads)");
    }
  }
  if (args.iters < 1) fail<InvalidArgument>("--iters ", args.iters, " must be at least 1");
  if (args.backend == "mpi" && args.sizes.size() > 1) {
    fail<InvalidArgument>("--backend mpi takes one --ranks value, not ", args.sizes.size(),
                          " (mpirun starts one world per run)");
  }
  for (const int ranks : args.sizes) {
    Args one = args;
    one.ranks = ranks;
    run_one(one);
  }
}

void run_one(const Args& args) {
  if (args.backend == "inproc") {
    print(args, run_threads(args));
  } else if (args.backend == "mpi") {
    if (!control::launched_by_mpirun()) {
      relaunch_under_mpirun(args);
      return;
    }
    control::Options options;
    options.rank = -1;
    options.size = -1;
    auto comm = control::connect("mpi", options);
    if (comm->size() != args.ranks) {
      fail<InvalidArgument>("--ranks ", args.ranks, " but mpirun started ", comm->size(),
                            " ranks (pass the same number to both)");
    }
    const auto figures = measure(*comm, args.iters);
    if (comm->rank() == 0) print(args, figures);
  } else {
    print(args, run_forked(args));
  }
}

}  // namespace

void add_bench_control(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  auto* cmd = bench.add_subcommand(
      "control", "All-reduce latency of the control plane (4 int64 values) over N ranks");
  cmd->add_option("--backend", args->backend, "inproc | shm | gloo | mpi (those built)")
      ->capture_default_str();
  cmd->add_option("--ranks", args->sizes_text,
                  "Number of ranks; a comma-separated list (8,32,64) measures each in turn")
      ->capture_default_str();
  cmd->add_option("--iters", args->iters, "Measured all-reduces")->capture_default_str();
  cmd->add_flag("--json", args->json,
                "Print one JSON object per size, one a line: backend, ranks, p50_us, p99_us");
  cmd->callback([args] {
    args->sizes = parse_int_list("--ranks", args->sizes_text);
    run(*args);
  });
}

}  // namespace eplb::cli
