#include "eplb/transport/registry.h"

#include <functional>
#include <utility>

#include "eplb/config.h"
#include "eplb/core/error.h"
#include "transport/inproc/transport.h"
#include "transport/shm/transport.h"
#if EPLB_HAVE_UCX
#include "transport/hybrid/transport.h"
#include "transport/ucx/transport.h"
#endif
#if EPLB_HAVE_CUDA
#include "transport/cuda/transport.h"
#endif

namespace eplb::transport {
namespace {

using Factory = std::function<std::unique_ptr<Transport>(const Options&)>;

const std::vector<std::pair<std::string, Factory>>& factories() {
  static const std::vector<std::pair<std::string, Factory>> table = [] {
    std::vector<std::pair<std::string, Factory>> t;
    t.emplace_back("inproc", &inproc::create);
    t.emplace_back("shm", &shm::create);
#if EPLB_HAVE_UCX
    t.emplace_back("ucx", &ucx::create);
    t.emplace_back("hybrid", &hybrid::create);
#endif
#if EPLB_HAVE_CUDA
    t.emplace_back("cuda", &cuda::create);
#endif
    return t;
  }();
  return table;
}

}  // namespace

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : factories()) names.push_back(name);
  return names;
}

bool has_backend(std::string_view name) {
  for (const auto& [known, factory] : factories()) {
    if (known == name) return true;
  }
  return false;
}

std::unique_ptr<Transport> create(std::string_view name, const Options& options) {
  for (const auto& [known, factory] : factories()) {
    if (known == name) return factory(options);
  }
  std::string built;
  for (const auto& [known, factory] : factories()) built += (built.empty() ? "" : "|") + known;
  const char* hint = name == "ucx" || name == "hybrid"
                         ? "; ucx and hybrid need libucx-dev and -DEPLB_WITH_UCX=ON"
                     : name == "cuda" ? "; cuda needs the CUDA toolkit and -DEPLB_WITH_CUDA=ON"
                                      : "";
  fail<InvalidArgument>("unknown transport backend '", name, "' (this build has ", built, hint,
                        ")");
}

}  // namespace eplb::transport
