// The table of every config key zerort knows, one row per key: its JSON path, the Config member it
// fills, its type and range, how it takes "auto", its other spelling, and for a key that changes
// nothing here, why. zero/config.cc drives everything from it: the key checks and their
// did-you-mean, the readers and range checks, operator==, ResolvedConfigJson, and
// //zero:config_test checks docs/config.md against it. Adding a scalar key is one row here, its
// member in zero/config.h and its row in docs/config.md.
//
//   Int("fp16.hysteresis", ZERORT_CONFIG_MEMBER(fp16.hysteresis), 1),   // >= 1, <= INT_MAX
//   Foreign("fp16.auto_cast", "casting the model's inputs belongs to the trainer"),
//
// Rules no row can state (stage's number or "auto", precision, keys that must agree, the
// param_groups block) stay hand-written in zero/config.cc, and the scheduler block in
// internal/config_scheduler.cc; their rows say Custom::k..., so that the key is still known,
// checked for spelling, written and compared.
//
// A key's default is its member's in-class initializer in zero/config.h, never repeated here:
// the writer, the docs test and "absent" all read it off Config{}.
//
// Row order is meaningful: ResolvedConfigJson writes settings in table order (the order of the
// Settings table in docs/config.md), the parser reads them in that order, and "did you mean"
// lists a block's keys in that order. The rows of one block are contiguous.
//
// Thread safety: the table is immutable after its first use; ConfigKeys() is thread-safe.
#ifndef ZERORT_ZERO_INTERNAL_CONFIG_KEYS_H_
#define ZERORT_ZERO_INTERNAL_CONFIG_KEYS_H_

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <variant>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "zero/config.h"

namespace zerort {
namespace config_internal {

inline constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
inline constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// One Config member, read-write for the parser and read-only for the writer and operator==.
// Written with ZERORT_CONFIG_MEMBER(path.to.member).
template <typename T>
struct Member {
  T& (*at)(Config&);
  const T& (*get)(const Config&);
};

template <typename T>
Member<T> MemberOf(T& (*at)(Config&), const T& (*get)(const Config&)) {
  return {at, get};
}

#define ZERORT_CONFIG_MEMBER(m)                                                     \
  ::zerort::config_internal::MemberOf(                                              \
      +[](::zerort::Config& c) -> auto& { return c.m; },                            \
      +[](const ::zerort::Config& c) -> const auto& { return c.m; })

// The member's C++ type is the key's JSON type: bool is true/false, int and int64_t are integers
// (integral floats such as 5e8 accepted), double a number, std::string a string or null,
// optional<DType> "fp32"/"bf16"/"fp16" or null, OffloadDevice "none"/"cpu"/"nvme".
using AnyMember = std::variant<std::monostate, Member<bool>, Member<int>, Member<int64_t>,
                               Member<double>, Member<std::string>, Member<std::optional<DType>>,
                               Member<OffloadDevice>>;

struct DoubleRange {
  double lo;
  bool lo_open;  // lo excluded
  double hi;     // +inf: no upper bound
  bool hi_open;
};
inline constexpr DoubleRange kNonNegative{0, false, INFINITY, false};
inline constexpr DoubleRange kPositive{0, true, INFINITY, false};

enum class Role {
  kSetting,   // read, range-checked, written by ResolvedConfigJson, compared by operator==
  kNoEffect,  // a DeepSpeed switch for what zerort always does: type-checked, noted, not a setting
  kForeign,   // a DeepSpeed key zerort does not act on: any value (or only DeepSpeed's default)
  kInput,     // read, but not a setting: batch sizes, deprecated spellings of other settings
};

// Keys whose reading is a hand-written rule in zero/config.cc (writing and comparing too, unless
// the row names a member).
enum class Custom {
  kNone,
  kStage,             // 0..3 or "auto" (stage_auto)
  kBf16Enabled,       // true/false/"auto" -> compute_dtype
  kFp16Enabled,       // same, and not together with bf16
  kOptimizerType,     // "AdamW" or "Adam", case-insensitive
  kBetas,             // [beta1, beta2] or "auto"
  kScheduler,         // the scheduler block (zero/lr_schedule.h)
  kParamGroups,       // the array of param groups
  kBatchSize,         // >= 1 or "auto" (= 0), with a note
  kCpuOffload,        // deprecated: offload_optimizer.device "cpu"/"none"
  kCpuOffloadParam,   // deprecated: offload_param.device "cpu"/"none"
  kCpuOffloadPinned,  // deprecated: pin_memory of both offloads
};

// How a key takes the string "auto" (Hugging Face's "the trainer fills this in").
enum class AutoRule {
  kNone,           // "auto" is a wrong value
  kRecorded,       // listed in Config::auto_keys for ResolveAuto; errors do not mention it
  kRecordedNamed,  // the same, and a wrong value's error says `or "auto"`
  kUnitSize,       // stored as kAutoSize, for the planner to derive from the model
};

struct KeyDef {
  const char* path;  // canonical JSON path, "zero_optimization.offload_param.buffer_size"
  Role role = Role::kSetting;
  AnyMember member;
  Custom custom = Custom::kNone;
  int64_t int_lo = 0, int_hi = kInt64Max;  // integer members: the accepted range
  DoubleRange real = kNonNegative;         // double members: the accepted range
  AutoRule auto_rule = AutoRule::kNone;
  const char* alias = nullptr;       // DeepSpeed's other spelling of the last path element
  const char* why = nullptr;         // kNoEffect, kForeign: why it changes nothing here
  const char* turned_off = nullptr;  // kNoEffect booleans: what `false` asks to turn off
  const char* only_value = nullptr;  // kForeign: accepted only with this value (JSON text)

  KeyDef Alias(const char* a) const;
  KeyDef Auto(AutoRule rule) const;
  // A key with no effect here. `off`: for a boolean, the behaviour that `false` cannot turn off.
  KeyDef NoEffect(const char* reason, const char* off = nullptr) const;
  KeyDef Input() const;
};

// Row builders, one per kind of key.
template <typename T>
KeyDef Scalar(const char* path, Member<T> m) {  // bool, string, dtype, offload device
  KeyDef k{path};
  k.member = m;
  return k;
}
KeyDef Int(const char* path, Member<int> m, int64_t lo, int64_t hi = kIntMax);
KeyDef Int64(const char* path, Member<int64_t> m, int64_t lo);
KeyDef Real(const char* path, Member<double> m, DoubleRange range);
KeyDef Hand(const char* path, Custom custom);
template <typename T>
KeyDef Hand(const char* path, Custom custom, Member<T> m) {
  KeyDef k = Scalar(path, m);
  k.custom = custom;
  return k;
}
// A DeepSpeed key with no effect here: any value, or with `only_value` that value alone.
KeyDef Foreign(const char* path, const char* why, const char* only_value = nullptr);

// A block DeepSpeed also spells another way ("bfloat16" for "bf16").
struct BlockAlias {
  const char* block;
  const char* alias;
};

// Every key, in the order described above.
absl::Span<const KeyDef> ConfigKeys();
absl::Span<const BlockAlias> ConfigBlockAliases();

// "a.b.c" -> "a.b" ("" at the top level), and -> "c".
absl::string_view ParentPath(absl::string_view path);
absl::string_view LeafName(absl::string_view path);

}  // namespace config_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_CONFIG_KEYS_H_
