#include "zero/testing/link_bytes_check.h"

#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/inprocess.h"

namespace zerort {
namespace testing {

absl::StatusOr<std::vector<RankLinkBytes>> MeasureLinkBytes(int world, int ranks_per_node,
                                                            const LinkBytesRun& run) {
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<comm::Communicator>> comms,
                   comm::CreateInProcessGroup(world));
  std::vector<RankLinkBytes> out(world);
  std::vector<absl::Status> status(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> absl::Status {
        comm::LinkByteLog log;
        ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> counted,
                         comm::CountLinkBytes(comms[r].get(), ranks_per_node, &log));
        ASSIGN_OR_RETURN(out[r].plan, run(counted.get(), &log));
        out[r].sent = log.Total();
        out[r].log = log.ToString();
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) RETURN_IF_ERROR(Annotate(status[r], absl::StrCat("rank ", r)));
  return out;
}

absl::Status TrainStandardOrder(Engine& engine, int steps) {
  const int gas = engine.plan().options.gradient_accumulation_steps;
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < gas; ++micro) {
      for (int u = engine.num_units() - 1; u >= 0; --u) {
        RETURN_IF_ERROR(engine.Gather(u));
        RETURN_IF_ERROR(engine.Release(u));
      }
      for (int u = 0; u < engine.num_units(); ++u) {
        RETURN_IF_ERROR(engine.Gather(u));
        for (int i : engine.plan().units[u].params) {
          if (engine.frozen(i)) continue;
          RETURN_IF_ERROR(engine.grad(i).status());
          RETURN_IF_ERROR(engine.GradReady(i));
        }
        RETURN_IF_ERROR(engine.Release(u));
      }
      RETURN_IF_ERROR(engine.Step().status());
    }
  }
  return absl::OkStatus();
}

LinkBytesComparison CompareWithPlan(const memory::Plan& plan, const comm::LinkBytes& sent,
                                    int steps) {
  LinkBytesComparison c;
  c.measured = {sent.intra_node / steps, sent.inter_node / steps};
  c.divisible = sent.intra_node % steps == 0 && sent.inter_node % steps == 0;
  c.planned = {plan.comm_bytes_intra_node_per_step, plan.comm_bytes_inter_node_per_step};
  c.planned_control = plan.comm_control_bytes_per_step;
  return c;
}

std::string LinkBytesComparison::ToString() const {
  return absl::StrCat("per step: intra-node measured ", measured.intra_node, " planned ",
                      planned.intra_node, ", inter-node measured ", measured.inter_node,
                      " planned ", planned.inter_node, " (of which control exchange ",
                      planned_control, ")", divisible ? "" : ", not a whole number of steps");
}

}  // namespace testing
}  // namespace zerort
