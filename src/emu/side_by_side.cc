// Runs side by side (emulator.h): each run_local in a process of its own, started together, so
// that the runs of `eplb run --compare` share the machine's conditions; results carried back
// as JSON through a scratch folder.
//
// Processes: this one (the parent) forks one launcher per run; each launcher is the leader of
// a process group of its own and forks its ranks (run_local). The parent passes SIGINT and
// SIGTERM on to the launchers; a launcher dies with the parent (PR_SET_PDEATHSIG: SIGTERM, which
// stops its ranks at the same step), and its ranks die with it.

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "eplb/control/launch.h"
#include "eplb/core/error.h"
#include "emu/emulator.h"

namespace eplb::emu {
namespace {

using nlohmann::json;

json step_json(const StepFigures& s) {
  return {s.balancedness, s.moe_ms, s.moe_wall_ms, s.stall_ms, s.installs, s.unavailable,
          s.dropped, s.moe_ms_predicted, s.moe_ms_floor, s.time_balancedness};
}

StepFigures step_from(const json& j) {
  return {.balancedness = j.at(0).get<double>(),
          .moe_ms = j.at(1).get<double>(),
          .moe_wall_ms = j.at(2).get<double>(),
          .moe_ms_predicted = j.at(7).get<double>(),
          .moe_ms_floor = j.at(8).get<double>(),
          .time_balancedness = j.at(9).get<double>(),
          .stall_ms = j.at(3).get<double>(),
          .installs = j.at(4).get<int64_t>(),
          .unavailable = j.at(5).get<bool>(),
          .dropped = j.at(6).get<int64_t>()};
}

json lost_json(const LostRank& l) { return {l.rank, l.step, l.planned, l.how}; }

LostRank lost_from(const json& j) {
  return {.rank = j.at(0).get<int>(),
          .step = j.at(1).get<int64_t>(),
          .planned = j.at(2).get<bool>(),
          .how = j.at(3).get<std::string>()};
}

json rebalance_json(const RebalanceFigures& f) {
  return {{"trigger_step", f.trigger_step},
          {"end_step", f.end_step},
          {"outcome", f.outcome},
          {"error", f.error},
          {"slots_moved", f.slots_moved},
          {"bytes_moved", f.bytes_moved},
          {"bytes_local_copy", f.bytes_local_copy},
          {"bytes_installed", f.bytes_installed},
          {"stall_total_ms", f.stall_total_ms},
          {"stall_max_ms", f.stall_max_ms},
          {"stall_preempted_ms", f.stall_preempted_ms},
          {"predicted_before", f.predicted_before},
          {"predicted_after", f.predicted_after},
          {"gain", {f.gain_checked, f.below_min_gain, f.priced, f.moe_ms_modeled_before,
                    f.moe_ms_modeled_after, f.predicted_gain_ms, f.price_ms}}};
}

RebalanceFigures rebalance_from(const json& j) {
  RebalanceFigures f;
  f.trigger_step = j.at("trigger_step").get<int64_t>();
  f.end_step = j.at("end_step").get<int64_t>();
  f.outcome = j.at("outcome").get<std::string>();
  f.error = j.at("error").get<std::string>();
  f.slots_moved = j.at("slots_moved").get<int64_t>();
  f.bytes_moved = j.at("bytes_moved").get<int64_t>();
  f.bytes_local_copy = j.at("bytes_local_copy").get<int64_t>();
  f.bytes_installed = j.at("bytes_installed").get<int64_t>();
  f.stall_total_ms = j.at("stall_total_ms").get<double>();
  f.stall_max_ms = j.at("stall_max_ms").get<double>();
  f.stall_preempted_ms = j.at("stall_preempted_ms").get<double>();
  f.predicted_before = j.at("predicted_before").get<double>();
  f.predicted_after = j.at("predicted_after").get<double>();
  const json& g = j.at("gain");
  f.gain_checked = g.at(0).get<bool>();
  f.below_min_gain = g.at(1).get<bool>();
  f.priced = g.at(2).get<bool>();
  f.moe_ms_modeled_before = g.at(3).get<double>();
  f.moe_ms_modeled_after = g.at(4).get<double>();
  f.predicted_gain_ms = g.at(5).get<double>();
  f.price_ms = g.at(6).get<double>();
  return f;
}

// The children of run_side_by_side (0 once reaped), for the handler that passes a stop signal
// on to them.
constexpr size_t kMaxRuns = 8;
std::atomic<pid_t> g_children[kMaxRuns];

void forward_signal(int signal) {
  for (std::atomic<pid_t>& child : g_children) {
    const pid_t pid = child.load();
    if (pid > 0) ::kill(pid, signal);
  }
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

std::string result_to_json(const RunResult& r) {
  json steps = json::array(), rebalances = json::array(), lost = json::array();
  for (const StepFigures& s : r.per_step) steps.push_back(step_json(s));
  for (const LostRank& l : r.lost) lost.push_back(lost_json(l));
  for (const RebalanceFigures& f : r.per_rebalance) rebalances.push_back(rebalance_json(f));
  return json{{"mode", r.mode},
              {"steps", r.steps},
              {"interrupted", r.interrupted},
              {"rebalances", r.rebalances},
              {"rebalances_triggered", r.rebalances_triggered},
              {"rebalances_below_min_gain", r.rebalances_below_min_gain},
              {"windows", {r.before_first, r.before_last, r.after_first, r.after_last}},
              {"balancedness", {r.balancedness_before, r.balancedness_after}},
              {"moe_ms", {r.moe_ms_before, r.moe_ms_after}},
              {"moe_wall_ms", {r.moe_wall_ms_before, r.moe_wall_ms_after}},
              {"cost", {{"model", r.cost_model ? json::parse(placement::cost_model_to_json(
                                                                *r.cost_model))
                                               : json(nullptr)},
                        {"error", r.cost_fit_error},
                        {"samples", r.cost_samples},
                        {"predicted", {r.moe_ms_predicted_before, r.moe_ms_predicted_after}},
                        {"floor", {r.moe_ms_floor_before, r.moe_ms_floor_after}}}},
              {"time_balancedness", {r.time_balancedness_before, r.time_balancedness_after}},
              {"bytes", {r.bytes_moved, r.bytes_local_copy, r.bytes_installed}},
              {"stall", {r.stall_max_ms, r.stall_total_ms, r.stall_preempted_ms}},
              {"checks", {r.mismatches, r.verified, r.outputs}},
              {"bytes_held", r.bytes_held},
              {"elastic", {r.kills, r.rejoins, r.unavailable_steps, r.no_service_steps,
                           r.restored_bytes, r.tokens_dropped}},
              {"lost", std::move(lost)},
              {"stopped", r.stopped},
              {"wall_s", r.wall_s},
              {"metrics", r.metrics},
              {"per_step", std::move(steps)},
              {"per_rebalance", std::move(rebalances)}}
      .dump();
}

RunResult result_from_json(const std::string& text) {
  try {
    const json j = json::parse(text);
    RunResult r;
    r.mode = j.at("mode").get<std::string>();
    r.steps = j.at("steps").get<int64_t>();
    r.interrupted = j.at("interrupted").get<bool>();
    r.rebalances = j.at("rebalances").get<int64_t>();
    r.rebalances_triggered = j.at("rebalances_triggered").get<int64_t>();
    r.rebalances_below_min_gain = j.at("rebalances_below_min_gain").get<int64_t>();
    const json& w = j.at("windows");
    r.before_first = w.at(0).get<int64_t>();
    r.before_last = w.at(1).get<int64_t>();
    r.after_first = w.at(2).get<int64_t>();
    r.after_last = w.at(3).get<int64_t>();
    r.balancedness_before = j.at("balancedness").at(0).get<double>();
    r.balancedness_after = j.at("balancedness").at(1).get<double>();
    r.moe_ms_before = j.at("moe_ms").at(0).get<double>();
    r.moe_ms_after = j.at("moe_ms").at(1).get<double>();
    r.moe_wall_ms_before = j.at("moe_wall_ms").at(0).get<double>();
    r.moe_wall_ms_after = j.at("moe_wall_ms").at(1).get<double>();
    const json& cost = j.at("cost");
    if (!cost.at("model").is_null()) {
      r.cost_model = placement::cost_model_from_json(cost.at("model").dump(), "the run's model");
    }
    r.cost_fit_error = cost.at("error").get<std::string>();
    r.cost_samples = cost.at("samples").get<int64_t>();
    r.moe_ms_predicted_before = cost.at("predicted").at(0).get<double>();
    r.moe_ms_predicted_after = cost.at("predicted").at(1).get<double>();
    r.moe_ms_floor_before = cost.at("floor").at(0).get<double>();
    r.moe_ms_floor_after = cost.at("floor").at(1).get<double>();
    r.time_balancedness_before = j.at("time_balancedness").at(0).get<double>();
    r.time_balancedness_after = j.at("time_balancedness").at(1).get<double>();
    r.bytes_moved = j.at("bytes").at(0).get<int64_t>();
    r.bytes_local_copy = j.at("bytes").at(1).get<int64_t>();
    r.bytes_installed = j.at("bytes").at(2).get<int64_t>();
    r.stall_max_ms = j.at("stall").at(0).get<double>();
    r.stall_total_ms = j.at("stall").at(1).get<double>();
    r.stall_preempted_ms = j.at("stall").at(2).get<double>();
    r.mismatches = j.at("checks").at(0).get<int64_t>();
    r.verified = j.at("checks").at(1).get<int64_t>();
    r.outputs = j.at("checks").at(2).get<int64_t>();
    r.bytes_held = j.at("bytes_held").get<int64_t>();
    const json& elastic = j.at("elastic");
    r.kills = elastic.at(0).get<int64_t>();
    r.rejoins = elastic.at(1).get<int64_t>();
    r.unavailable_steps = elastic.at(2).get<int64_t>();
    r.no_service_steps = elastic.at(3).get<int64_t>();
    r.restored_bytes = elastic.at(4).get<int64_t>();
    r.tokens_dropped = elastic.at(5).get<int64_t>();
    for (const json& l : j.at("lost")) r.lost.push_back(lost_from(l));
    r.stopped = j.at("stopped").get<std::string>();
    r.wall_s = j.at("wall_s").get<double>();
    r.metrics = j.at("metrics").get<std::string>();
    for (const json& s : j.at("per_step")) r.per_step.push_back(step_from(s));
    for (const json& f : j.at("per_rebalance")) r.per_rebalance.push_back(rebalance_from(f));
    return r;
  } catch (const json::exception& e) {
    fail<IoError>("a run's result could not be read back: ", e.what());
  }
}

std::vector<RunResult> run_side_by_side(const std::vector<RunOptions>& runs,
                                        const Workload& workload) {
  EPLB_CHECK(!runs.empty() && runs.size() <= kMaxRuns, "run_side_by_side: ", runs.size(),
             " runs (expected 1 to ", kMaxRuns, ")");
  const control::ScratchFolder scratch("eplb-side-by-side");
  // Step 1: fork with stop signals blocked and the forwarding handler in place, so that a
  // signal arriving meanwhile reaches every run. Each run gets a process group of its own: a
  // Ctrl-C at the terminal then reaches this process alone, which passes it on once (the runs'
  // own handlers take a second signal as "stop now"); and it dies with this process.
  std::fflush(stdout);  // or each child would print what is buffered again
  std::fflush(stderr);
  sigset_t stops, old_mask;
  sigemptyset(&stops);
  sigaddset(&stops, SIGINT);
  sigaddset(&stops, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &stops, &old_mask);
  struct sigaction action {};
  action.sa_handler = forward_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  ::sigaction(SIGINT, &action, &old_int);
  ::sigaction(SIGTERM, &action, &old_term);
  for (std::atomic<pid_t>& child : g_children) child.store(0);
  auto restore = [&] {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  };
  // Waits for every child still running; returns their statuses by index (-1: lost).
  std::vector<int> status(runs.size(), -1);
  auto reap = [&](bool stop_all_on_failure) {
    size_t running = 0;
    for (std::atomic<pid_t>& child : g_children) running += child.load() > 0 ? 1 : 0;
    bool stopping = false;
    while (running > 0) {
      int st = 0;
      const pid_t pid = ::waitpid(-1, &st, 0);
      if (pid < 0) {
        if (errno == EINTR) continue;
        break;  // no child left to wait for: the others count as lost
      }
      for (size_t i = 0; i < runs.size(); ++i) {
        if (g_children[i].load() != pid) continue;
        g_children[i].store(0);
        status[i] = st;
        --running;
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && stop_all_on_failure && !stopping) {
          stopping = true;  // one run failed: the comparison is lost, stop the others
          forward_signal(SIGTERM);
        }
      }
    }
  };
  const pid_t parent = ::getpid();
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string out = scratch.path() + "/" + std::to_string(i);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int error = errno;
      forward_signal(SIGTERM);
      reap(false);
      restore();
      fail<IoError>("fork of the ", runs[i].mode, " run failed: ", std::strerror(error));
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) std::_Exit(125);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      int code = 0;
      try {
        std::ofstream(out + ".json") << result_to_json(run_local(runs[i], workload));
      } catch (const std::exception& e) {
        std::ofstream(out + ".err") << e.what();
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(code);
    }
    g_children[i].store(pid);
  }
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);  // signals now go to the handler

  // Step 2: wait for all; a failed run stops the others.
  reap(true);
  restore();

  // Step 3: the results, or the first failure (the run that failed first by index).
  std::vector<RunResult> results;
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string out = scratch.path() + "/" + std::to_string(i);
    const std::string why = read_text(out + ".err");
    if (!why.empty()) fail<IoError>("the ", runs[i].mode, " run failed: ", why);
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string out = scratch.path() + "/" + std::to_string(i);
    const int st = status[i];
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fail<IoError>("the ", runs[i].mode, " run failed: ",
                    st == -1 ? std::string("it was lost (no exit status)")
                    : WIFSIGNALED(st)
                        ? std::string("killed by signal ") + std::to_string(WTERMSIG(st)) + " (" +
                              strsignal(WTERMSIG(st)) + ")"
                        : std::string("exit status ") + std::to_string(WEXITSTATUS(st)));
    }
    results.push_back(result_from_json(read_text(out + ".json")));
  }
  return results;
}

}  // namespace eplb::emu
