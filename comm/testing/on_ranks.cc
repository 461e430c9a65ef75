#include "comm/testing/on_ranks.h"

#include <memory>
#include <thread>

#include "comm/inprocess.h"

namespace zerort {
namespace comm {
namespace testing {

std::vector<absl::Status> OnRanks(int world, const CommOptions& options,
                                  const std::function<absl::Status(int rank, Communicator*)>& fn) {
  std::vector<std::unique_ptr<Communicator>> comms =
      CreateInProcessGroup(world, options).value();  // a test's own options: valid
  std::vector<absl::Status> st(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { st[r] = fn(r, comms[r].get()); });
  }
  for (std::thread& t : threads) t.join();
  return st;
}

}  // namespace testing
}  // namespace comm
}  // namespace zerort
