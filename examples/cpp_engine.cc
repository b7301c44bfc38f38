// A complete expert-parallel engine in C++, with eplb embedded through its public headers only.
// Each rank (a process) hands eplb the engine's own things at the four seams (docs/embedding.md):
//   collectives  a control plane from torchrun's variables (connect_from_env), eplb's alone;
//   weights      tensors "up" and "down" [slots_per_rank][I * H] per layer, the engine's,
//                registered (WeightSpec::engine): peers read them in place, installs rewrite
//                the slots whose expert changes;
//   maps         vLLM's logical_to_physical_map, logical_replica_count, physical_to_logical_map:
//                the router reads them, eplb rewrites a layer's rows at its install (bind_maps);
//   counters     tokens per slot of the pass, [L][P] (vLLM's expert_load_pass): record_pass();
// and calls step_end() once per pass. Tokens pick K experts of a skewed load whose favourites
// move halfway. Weights and activations are dyadic fractions, so every sum is exact in float32:
// each output must equal, bit for bit, that of a one-process reference holding every expert.
//
// Four ranks on one machine (docs/launch.md; or torchrun --no-python, with gloo and
// EPLB_RENDEZVOUS a fresh folder); the argument names the transport: shm (default) or ucx.
//   export WORLD_SIZE=4 EPLB_CONTROL_BACKEND=shm EPLB_RENDEZVOUS=demo-$$
//   for r in 0 1 2 3; do RANK=$r ./cpp_engine & done; wait
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "eplb/control/launch.h"
#include "eplb/core/types.h"
#include "eplb/runtime/rebalancer.h"
#include "eplb/transport/registry.h"
#include "eplb/transport/shareable.h"

namespace {
using namespace eplb;

// Layers, experts, slots, top-k, hidden, intermediate, tokens per rank and step, steps (at least).
constexpr int64_t L = 3, E = 16, P = 24, K = 2, H = 8, I = 16, T = 32, kSteps = 32;
constexpr int64_t R = P - E + 1;  // the maps' replica width: the most replicas of one expert
constexpr int64_t F = I * H;      // floats of one expert in each tensor (up [I][H], down [H][I])

// Tensor `tensor` (0 up, 1 down) of `expert` of `layer`, as a checkpoint holds it: {-2..2} / 8.
void load_expert(int64_t layer, int64_t tensor, int64_t expert, float* out) {
  std::mt19937_64 random((layer * 2 + tensor) * E + expert);
  for (int64_t i = 0; i < F; ++i) out[i] = static_cast<float>(random() % 5) / 8 - 0.25F;
}
// One expert on one token: y = down . relu(up . x), up [I][H] and down [H][I] row-major.
void expert_forward(const float* up, const float* down, const float* x, float* y) {
  float h[I] = {};
  for (int64_t i = 0; i < I * H; ++i) h[i / H] += up[i] * x[i % H];
  std::fill(y, y + H, 0.0F);
  for (int64_t i = 0; i < H * I; ++i) y[i / I] += down[i] * std::max(h[i % I], 0.0F);
}
// The layer's output: the residual plus the K experts' outputs, rounded to quarters in [-2, 2].
void combine(float* x, const float* ys) {
  for (int64_t j = 0; j < H; ++j) {
    float total = x[j];
    for (int64_t k = 0; k < K; ++k) total += ys[k * H + j];
    x[j] = std::clamp(std::round(total * 2) / 4, -2.0F, 2.0F);
  }
}
// A token's K distinct experts in `layer`: a few favourites, which move at step kSteps / 2.
void choose_experts(std::mt19937_64& random, int64_t step, int64_t layer, int32_t* experts) {
  for (int64_t k = 0; k < K; ++k) {
    const double u = static_cast<double>(random() >> 11) * 0x1p-53;
    int64_t e = static_cast<int64_t>(u * u * u * E) + 5 * layer + (step < kSteps / 2 ? 0 : E / 2);
    while (std::find(experts, experts + k, e % E) != experts + k) ++e;
    experts[k] = static_cast<int32_t>(e % E);
  }
}

int run(int argc, char** argv) {
  // Collectives: eplb's control plane from RANK, WORLD_SIZE, EPLB_RENDEZVOUS, ...; and the
  // engine's own group beside it, for its tokens (a GPU engine's all-to-all runs on NCCL).
  const std::unique_ptr<control::Communicator> control = control::connect_from_env();
  const control::LaunchInfo info = *control::launch_info_from_env();
  // The engine's own group (rank, size, rendezvous, group name, timeout, hostname), beside eplb's.
  const control::Options options{info.rank, info.size, info.rendezvous, "engine", info.timeout, ""};
  const std::unique_ptr<control::Communicator> engine_group =
      control::connect(info.backend, options);
  const int rank = control->rank(), world = control->size();
  const auto all_to_all = [&](const std::vector<float>& mine) {  // every rank's, by rank
    std::vector<std::vector<float>> all;
    for (const control::Bytes& b : engine_group->all_gather(std::as_bytes(std::span(mine)))) {
      all.emplace_back(b.size() / sizeof(float));
      if (!b.empty()) std::memcpy(all.back().data(), b.data(), b.size());
    }
    return all;
  };
  runtime::Config config;
  config.layout = {.experts = E, .physical = P, .ranks = world};
  config.interval = config.window = 8;
  config.on_error = runtime::OnError::kRaise;  // a failed rebalance throws from step_end()
  const int64_t spr = config.layout.slots_per_rank();

  // Weights: the engine's, [L][up, down][spr][F], loaded per its first placement (slot p holds
  // expert p % E, as vLLM starts). Shareable memory (transport/shareable.h) lets shm peers map
  // it; any host memory works (read by cross-memory attach). Freed after the transport closes.
  const Placement initial = trivial_placement(L, E, P);
  const std::unique_ptr<void, decltype(&transport::free_shareable)> memory(
      transport::allocate_shareable(L * 2 * spr * F * sizeof(float)), transport::free_shareable);
  const auto tensor = [&](int64_t l, int64_t t, int64_t slot) {
    return static_cast<float*>(memory.get()) + ((l * 2 + t) * spr + slot) * F;
  };
  runtime::WeightSpec spec{.layers = L, .tensors = {{"up", F * 4}, {"down", F * 4}}};
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t t = 0; t < 2; ++t) {
      for (int64_t j = 0; j < spr; ++j)
        load_expert(l, t, initial.layer_phy2log(l)[rank * spr + j], tensor(l, t, j));
      spec.engine.push_back({.base = tensor(l, t, 0), .stride = 0});  // 0: slots back to back
    }
  }
  const std::unique_ptr<transport::Transport> transport =
      transport::create(argc > 1 ? argv[1] : "shm", {.rank = rank});
  runtime::Rebalancer rb(config, *control, *transport, spec, initial);
  rb.connect();  // before sizing anything else: registers the weights, reads from every peer

  // Maps and counters: the engine's tensors (strides {}: row-major), bound once; eplb writes
  // every map row now.
  std::vector<int64_t> log2phy(L * E * R), logcnt(L * E), phy2log(L * P);
  std::vector<int32_t> load_pass(L * P);
  using Type = runtime::IntTensor::Type;
  using Kind = runtime::MapKind;
  rb.bind_maps(
      {{Kind::kLogicalToPhysical, {log2phy.data(), Type::kInt64, {L, E, R}, {}}, "log2phy"},
       {Kind::kReplicaCount, {logcnt.data(), Type::kInt64, {L, E}, {}}, "logcnt"},
       {Kind::kPhysicalToLogical, {phy2log.data(), Type::kInt64, {L, P}, {}}, "phy2log"}});
  const runtime::IntTensor counts{load_pass.data(), Type::kInt32, {L, P}, {}};

  std::vector<float> x(T * H), want(T * H), ys(T * K * H), checkpoint(L * 2 * E * F);
  for (int64_t i = 0; i < L * 2 * E; ++i)
    load_expert(i / E / 2, i / E % 2, i % E, &checkpoint[i * F]);
  const auto expert = [&](int64_t l, int64_t t, int64_t e) {
    return &checkpoint[((l * 2 + t) * E + e) * F];
  };
  std::vector<int32_t> experts(T * K);
  int64_t mismatches = 0, checked = 0, checked_after_install = 0, after_last_install = -1;
  // The forward thread. Past kSteps it runs on until no rebalance is in flight and a step ran
  // after the last install: every rank stops at the same step, as they all install alike.
  for (int64_t step = 0; step < kSteps || rb.rebalancing() || step <= after_last_install; ++step) {
    std::mt19937_64 random(step * world + rank);  // this rank's tokens of this step
    for (float& v : x) v = static_cast<float>(random() % 17) / 4 - 2;
    want = x;
    for (int64_t l = 0; l < L; ++l) {
      // Route each (token, k) to a replica of its expert by the engine's maps, count its slot,
      // and make the request [slot, x[H]].
      for (int64_t t = 0; t < T; ++t) choose_experts(random, step, l, &experts[t * K]);
      std::vector<float> requests;
      for (int64_t i = 0; i < T * K; ++i) {
        const int64_t e = experts[i], id = (step * world + rank) * T * K + i;
        const int64_t slot = log2phy[(l * E + e) * R + id % logcnt[l * E + e]];
        ++load_pass[l * P + slot];
        requests.push_back(static_cast<float>(slot));
        requests.insert(requests.end(), x.begin() + i / K * H, x.begin() + (i / K + 1) * H);
      }
      // Dispatch every rank's requests to every rank; compute those of this rank's slots with
      // the weights in them, at [sender][request] (a real all-to-all sends each only its own).
      const std::vector<std::vector<float>> sent = all_to_all(requests);
      std::vector<float> served(world * T * K * H);
      for (int s = 0; s < world; ++s) {
        for (int64_t i = 0; i < T * K; ++i) {
          const float* request = &sent[s][i * (H + 1)];
          const int64_t j = static_cast<int64_t>(request[0]) - rank * spr;  // the local slot
          if (j < 0 || j >= spr) continue;
          expert_forward(tensor(l, 0, j), tensor(l, 1, j), request + 1,
                         &served[(s * T * K + i) * H]);
        }
      }
      // Return: each request's result from the rank of its slot.
      const std::vector<std::vector<float>> results = all_to_all(served);
      for (int64_t i = 0; i < T * K; ++i) {
        const auto server = static_cast<size_t>(static_cast<int64_t>(requests[i * (H + 1)]) / spr);
        std::copy_n(&results[server][(rank * T * K + i) * H], H, &ys[i * H]);
      }
      // The layer's outputs, and the same layer in one process with every expert at hand.
      for (int64_t t = 0; t < T; ++t) {
        combine(&x[t * H], &ys[t * K * H]);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = experts[t * K + k];
          expert_forward(expert(l, 0, e), expert(l, 1, e), &want[t * H], &ys[(t * K + k) * H]);
        }
        combine(&want[t * H], &ys[t * K * H]);
      }
    }
    for (int64_t t = 0; t < T; ++t)
      mismatches += std::memcmp(&x[t * H], &want[t * H], H * sizeof(float)) != 0;
    checked += T;
    checked_after_install += rb.installed_layers() > 0 ? T : 0;
    rb.record_pass(counts, runtime::CountsOf::kSlots);  // this pass's counters, read in place
    std::fill(load_pass.begin(), load_pass.end(), 0);
    const int64_t installed = rb.installed_layers();
    rb.step_end();  // may install a layer: the engine's weights and maps, on every rank alike
    if (rb.installed_layers() > installed) after_last_install = step + 1;
  }

  // The weights seam, checked directly: each slot holds the expert the engine's map names.
  int64_t wrong_slots = 0;
  for (int64_t i = 0; i < L * 2 * spr; ++i) {
    const int64_t l = i / spr / 2, t = i / spr % 2, e = phy2log[l * P + rank * spr + i % spr];
    wrong_slots += std::memcmp(tensor(l, t, i % spr), expert(l, t, e), F * sizeof(float)) != 0;
  }
  std::vector<int64_t> sums{checked, checked_after_install, mismatches, wrong_slots};
  engine_group->all_reduce(sums, control::ReduceOp::kSum);
  const int64_t installed = rb.installed_layers();
  const auto rebalances = static_cast<int64_t>(rb.history().size());
  rb.shutdown();
  const bool ok = installed > 0 && sums[1] > 0 && sums[2] == 0 && sums[3] == 0;
  if (rank == 0) {
    std::cout << "cpp_engine: " << world << " ranks, " << rebalances << " rebalances, " << installed
              << " layers installed, " << sums[0] << " outputs checked (" << sums[1]
              << " after the first install), " << sums[2] << " mismatches, " << sums[3]
              << " wrong slots: " << (ok ? "ok" : "FAILED") << std::endl;
  }
  return ok ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) try { return run(argc, argv); } catch (const std::exception& e) {
  std::cerr << "cpp_engine: " << e.what() << std::endl;
  return 1;
}
