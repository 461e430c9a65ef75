#include "base/json.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace zerort {
namespace {

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// A fresh file under the test's temporary directory holding `text`.
std::string TempFile(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST_CASE("Json: a valid document parses, keeping key order", "[base]") {
  absl::StatusOr<Json> j = ParseJson(R"({"b": 1, "a": [true, null, "x"]} )", "doc");
  REQUIRE(j.ok());
  CHECK(j->begin().key() == "b");
  CHECK((*j)["a"].size() == 3);
}

TEST_CASE("Json: duplicate keys are refused with their path", "[base]") {
  absl::Status s = ParseJson(R"({"a": {"b": [{"c": 1, "c": 2}]}})", "doc").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(s) == "doc: a.b[0].c: duplicate key (JSON would keep only one)");
  // The same key in sibling objects is not a duplicate.
  CHECK(ParseJson(R"({"a": {"k": 1}, "b": {"k": 1}})", "doc").ok());
}

TEST_CASE("Json: syntax errors name the text, line and column", "[base]") {
  absl::Status s = ParseJson("{\n  \"a\": 1,\n  oops\n}", "in.json").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StartsWith(Message(s), "in.json:3:3: not valid JSON: "));
  CHECK(absl::StartsWith(Message(ParseJson("", "empty").status()), "empty:1:1: not valid JSON"));
}

TEST_CASE("Json: bytes after the document are refused", "[base]") {
  for (const char* text : {"{} {}", "{}x", "[1] ,", "1 2"}) {
    INFO(text);
    absl::Status s = ParseJson(text, "doc").status();
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(Message(s), "not valid JSON"));
  }
  CHECK(ParseJson("{}\n\n  ", "doc").ok());  // trailing whitespace is fine
}

TEST_CASE("Json: a NUL byte is refused where it is", "[base]") {
  const std::string text("{\"a\":\n \"x\0y\"}", 13);
  absl::Status s = ParseJson(text, "doc").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(s) == "doc:2:4: not valid JSON: a NUL byte (binary data, not JSON text)");
  CHECK(!ParseJson(std::string("{}\0", 3), "doc").ok());
}

TEST_CASE("Json: nesting beyond the limit is refused with the path", "[base]") {
  const std::string deep = "{\"a\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  absl::Status s = ParseJson(deep, "doc").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(Message(s), "doc: a[0][0]"));
  CHECK(absl::StrContains(Message(s), "nested deeper than 32 levels"));
  JsonLimits two;
  two.max_depth = 2;
  CHECK(ParseJson("{\"a\": [1]}", "doc", two).ok());
  CHECK(!ParseJson("{\"a\": [[1]]}", "doc", two).ok());
}

TEST_CASE("Json: files are read within a size bound and must be regular", "[base]") {
  const std::string ok = TempFile("ok.json", "{\"a\": 1}");
  absl::StatusOr<Json> j = LoadJsonFile(ok, "config");
  REQUIRE(j.ok());
  CHECK((*j)["a"] == 1);

  absl::Status big = ReadBoundedFile(ok, "config", 4).status();
  CHECK(big.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(Message(big), ok));
  CHECK(absl::StrContains(Message(big), "limit of 4 bytes"));

  absl::Status dev = ReadBoundedFile("/dev/zero", "config").status();
  CHECK(dev.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(dev) == "cannot read config file \"/dev/zero\": not a regular file (a device, "
                        "FIFO or socket)");

  const std::string fifo = TempFile("fifo", "");
  std::remove(fifo.c_str());
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(ReadBoundedFile(fifo, "model").status().code() == absl::StatusCode::kInvalidArgument);

  absl::Status dir = ReadBoundedFile("/", "model").status();
  CHECK(dir.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(Message(dir), "cannot read model file \"/\""));

  absl::Status missing = ReadBoundedFile(ok + ".missing", "model").status();
  CHECK(missing.code() == absl::StatusCode::kNotFound);
  CHECK(absl::StrContains(Message(missing), ok + ".missing"));

  // A syntax error in a file names the file.
  const std::string bad = TempFile("bad.json", "{\"a\": 1,}");
  CHECK(absl::StartsWith(Message(LoadJsonFile(bad, "config").status()),
                         absl::StrCat(bad, ":1:9: not valid JSON")));
}

TEST_CASE("JsonFields: typed members name their path", "[base]") {
  const Json doc = *ParseJson(
      R"({"n": 3, "f": 2.0, "s": "text", "b": true, "arr": [1, 2], "o": {"x": -1}})", "doc");
  JsonFields root(doc, "top");
  CHECK(*root.Int("n", 0, 5) == 3);
  CHECK(Message(root.Int("n", 4, 5).status()) == "top.n: expected an integer in 4..5, got 3");
  CHECK(Message(root.Int("f", 0, 5).status()) == "top.f: expected an integer in 0..5, got 2.0");
  CHECK(*JsonToInt(doc["f"], "f", 0, 5, IntegralFloats::kAccept) == 2);
  CHECK(Message(root.Int("gone", 0, 5).status()) == "top.gone: missing");
  CHECK(*root.Number("f") == 2.0);
  CHECK(Message(root.Number("s").status()) == "top.s: expected a number, got \"text\"");
  CHECK(*root.String("s") == "text");
  CHECK(Message(root.String("s", 2).status()) ==
        "top.s: expected a string of at most 2 bytes, got \"text\"");
  CHECK(*root.Bool("b"));
  CHECK(Message(root.Bool("n").status()) == "top.n: expected true or false, got 3");
  CHECK((*root.Array("arr", 2))->size() == 2);
  CHECK(Message(root.Array("arr", 1).status()) ==
        "top.arr: expected an array of at most 1 entries, got an array");
  REQUIRE(root.Object("o").ok());
  JsonFields o(**root.Object("o"), root.Path("o"));
  CHECK(Message(o.Int("x", 0, 1).status()) == "top.o.x: expected an integer in 0..1, got -1");
  CHECK(Message(JsonFields(doc["arr"], "top.arr").Get("k").status()) ==
        "top.arr: expected an object, got an array");
  CHECK(root.Find("absent") == nullptr);
  CHECK(JsonPath("", "a") == "a");
  CHECK(JsonPath("a", 3) == "a[3]");
}

}  // namespace
}  // namespace zerort
