// The scheduler block: DeepSpeed's five learning-rate schedules with DeepSpeed's parameter names,
// defaults and required keys (zero/lr_schedule.h computes them). A structured block, so read and
// written by hand rather than by rows of the key table: only the parameters of the named type
// are accepted, and only they are written. Private to zero:config.
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_INTERNAL_CONFIG_SCHEDULER_H_
#define ZERORT_ZERO_INTERNAL_CONFIG_SCHEDULER_H_

#include <string>

#include "base/json.h"
#include "zero/config.h"
#include "zero/internal/config_reader.h"

namespace zerort {
namespace config_internal {

// The "scheduler" object `obj` (at `path`) into *s; every problem goes to `r`.
void ReadScheduler(Reader* r, const Json& obj, const std::string& path, SchedulerConfig* s);

// {"type": ..., "params": {...}} with the parameters of s.type, or null for kNone.
Json SchedulerJson(const SchedulerConfig& s);

}  // namespace config_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_CONFIG_SCHEDULER_H_
