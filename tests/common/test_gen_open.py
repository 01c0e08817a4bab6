#!/usr/bin/env python3
"""Tests for the open track's starter (tools/gen_open.py, run by tools/gen_stages.py): `python3 test_gen_open.py`.

Each test builds a tiny fake stage, solutions/07_demo with an open_track.json, in a temporary directory and runs
the generator on it with --root, as a subprocess, exactly as a user would. That the real open starters compile and
fail every test of their track is tools/check-starter --open's job (CI).
"""
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gen_stages.py"

CMAKE = "shardlab_stage_library(demo SOURCES src/demo.cpp src/given.cpp LINKS shardlab::earlier)\n"

PUBLIC_H = """\
#pragma once
/// @file demo.h
#include "shardlab/demo/given.h"

#include <map>
#include <string>

namespace shardlab::demo {

/// Options: all public, kept as they are.
struct Options {
  int width = 2;  ///< a field
};

/// A value type with a member defined in a source file.
struct Shape {
  int rows = 0;
  /// Defined out of line: stubbed, as its constructor and its comparison.
  explicit Shape(int r, Options options = {}) noexcept;
  int numel(int cols) const;
  bool operator==(const Shape& other) const;
  /// Inline: kept.
  int twice() const { return 2 * rows; }
};

/// An interface with a protected constructor and default bodies: kept as it is, nothing stubbed.
class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual int ahead() const { return 0; }

 protected:
  Schedule() = default;
};

/// The class the student designs.
class Wrapper : public Base {
 public:
  /// Contract of the constructor.
  Wrapper(Communicator& comm, Options options = {});
  /// An inline constructor with an initializer list: a declaration, cut before the list.
  explicit Wrapper(int width) noexcept : options_{width} {}
  ~Wrapper() override;
  Wrapper(const Wrapper&) = delete;

  /// The inline body reads private state: it becomes a declaration.
  int width() const { return options_.width; }
  /// A body over several lines, after a default argument that holds braces.
  void save(const std::map<std::string, std::string>& metadata = {}) {
    log(metadata);
    saved_ = true;
  }
  /// @cond INTERNAL
  /// The guided design's own seam: dropped.
  void advance();
  /// @endcond
  [[nodiscard]] std::string name(int index, double scale = 2.0) const;

 protected:
  /// The base class's contract: kept, body dropped.
  const Base& base() const override { return *this; }

 private:
  // ---- The solution's plumbing: dropped with its comments.
  void helper();
  Options options_;
  bool saved_ = false;
};

/// A free function: stubbed.
int count(const std::vector<int>& v);
/// A free function with a default argument that holds braces: stubbed.
Options tune(Options options = {});

/// An inline free function: kept as it is.
inline int one() { return 1; }

}  // namespace shardlab::demo
"""

EXPECTED_H = """\
#pragma once
/// @file demo.h
#include "shardlab/demo/given.h"

#include <map>
#include <string>

namespace shardlab::demo {

/// Options: all public, kept as they are.
struct Options {
  int width = 2;  ///< a field
};

/// A value type with a member defined in a source file.
struct Shape {
  int rows = 0;
  /// Defined out of line: stubbed, as its constructor and its comparison.
  explicit Shape(int r, Options options = {}) noexcept;
  int numel(int cols) const;
  bool operator==(const Shape& other) const;
  /// Inline: kept.
  int twice() const { return 2 * rows; }
};

/// An interface with a protected constructor and default bodies: kept as it is, nothing stubbed.
class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual int ahead() const { return 0; }

 protected:
  Schedule() = default;
};

/// The class the student designs.
class Wrapper : public Base {
 public:
  /// Contract of the constructor.
  Wrapper(Communicator& comm, Options options = {});
  /// An inline constructor with an initializer list: a declaration, cut before the list.
  explicit Wrapper(int width) noexcept;
  ~Wrapper() override;
  Wrapper(const Wrapper&) = delete;

  /// The inline body reads private state: it becomes a declaration.
  int width() const;
  /// A body over several lines, after a default argument that holds braces.
  void save(const std::map<std::string, std::string>& metadata = {});
  [[nodiscard]] std::string name(int index, double scale = 2.0) const;

 protected:
  /// The base class's contract: kept, body dropped.
  const Base& base() const override;

 private:
  // Your state: the open track gives none of the solution's members.
};

/// A free function: stubbed.
int count(const std::vector<int>& v);
/// A free function with a default argument that holds braces: stubbed.
Options tune(Options options = {});

/// An inline free function: kept as it is.
inline int one() { return 1; }

}  // namespace shardlab::demo
"""

STUBS = [
    "Shape::Shape(int r, Options options) noexcept {",
    "auto Shape::operator==(const Shape& other) const -> bool {",
    "Wrapper::Wrapper(int width) noexcept {",
    "auto Shape::numel(int cols) const -> int {",
    'throw ::shardlab::NotImplemented("07", "Shape::numel");',
    "Wrapper::Wrapper(Communicator& comm, Options options) {",
    "Wrapper::~Wrapper() = default;",
    "auto Wrapper::width() const -> int {",
    "auto Wrapper::save(const std::map<std::string, std::string>& metadata) -> void {",
    "auto Wrapper::name(int index, double scale) const -> std::string {",
    "auto Wrapper::base() const -> const Base& {",
    "auto count(const std::vector<int>& v) -> int {",
    "auto tune(Options options) -> Options {",
]
NOT_STUBBED = ["advance", "helper", "twice", "one()", "Wrapper(const Wrapper&)", "Schedule", "ahead"]


def check(what):
    print(f"  checked: {what}")


class GenOpenTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.sol = self.root / "solutions" / "07_demo"
        inc = self.sol / "include" / "shardlab" / "demo"
        inc.mkdir(parents=True)
        (self.sol / "src").mkdir()
        (inc / "demo.h").write_text(PUBLIC_H, encoding="utf-8")
        (inc / "given.h").write_text("#pragma once\nint given();\n", encoding="utf-8")
        (inc / "internal.h").write_text("#pragma once\nint internal();\n", encoding="utf-8")
        (self.sol / "src" / "given.cpp").write_text("int given() { return 1; }\n", encoding="utf-8")
        (self.sol / "src" / "demo.cpp").write_text("int internal() { return 2; }\n", encoding="utf-8")
        (self.sol / "CMakeLists.txt").write_text(CMAKE, encoding="utf-8")
        self.manifest({"public": ["include/shardlab/demo/demo.h"],
                       "given": ["include/shardlab/demo/given.h", "src/given.cpp"]})
        self.open = self.root / "stages" / "07_demo" / "open"

    def tearDown(self):
        self._tmp.cleanup()

    def manifest(self, spec):
        (self.sol / "open_track.json").write_text(json.dumps(spec), encoding="utf-8")

    def gen(self, *args):
        r = subprocess.run([sys.executable, str(SCRIPT), "--root", str(self.root), *args],
                           capture_output=True, text=True, encoding="utf-8")
        return r.returncode, r.stdout + r.stderr

    def test_the_open_starter_holds_the_public_surface_the_given_files_and_a_stub_per_function(self):
        rc, out = self.gen()
        self.assertEqual(rc, 0, out)
        files = sorted(p.relative_to(self.open).as_posix() for p in self.open.rglob("*") if p.is_file())
        self.assertEqual(files, ["CMakeLists.txt", "include/shardlab/demo/demo.h", "include/shardlab/demo/given.h",
                                 "src/given.cpp", "src/not_implemented.cpp"])
        check(f"the open starter's files: {files} (no internal header, no solution source)")
        header = (self.open / "include/shardlab/demo/demo.h").read_text(encoding="utf-8")
        self.assertEqual(header, EXPECTED_H)
        check("the public header: private section and internal block gone, inline bodies declarations, rest as is")
        self.assertEqual((self.open / "src/given.cpp").read_text(), "int given() { return 1; }\n")
        check("a given file is copied as it is")
        stubs = (self.open / "src/not_implemented.cpp").read_text(encoding="utf-8")
        for line in STUBS:
            self.assertIn(line, stubs)
        for name in NOT_STUBBED:
            self.assertNotIn(name, stubs)
        self.assertIn('#include "shardlab/demo/demo.h"', stubs)
        self.assertIn("namespace shardlab::demo {", stubs)
        check(f"{len(STUBS)} stub lines: qualified, trailing return types, no default arguments; none for the "
              f"deleted, internal, private or inline ones")
        cmake = (self.open / "CMakeLists.txt").read_text(encoding="utf-8")
        self.assertIn("shardlab_stage_library(demo SOURCES ${shardlab_open_sources} LINKS shardlab::earlier)", cmake)
        self.assertIn("GLOB_RECURSE shardlab_open_sources CONFIGURE_DEPENDS", cmake)
        check("CMakeLists.txt: the solution's library and links, from every .cpp under src/")
        self.assertFalse((self.root / "stages" / "07_demo" / "open_track.json").exists())
        self.assertEqual(self.gen("--check")[0], 0)
        check("the manifest is not copied into the guided starter; --check passes after generation")
        (self.open / "src" / "mine.cpp").write_text("// a student's file\n")
        rc, out = self.gen("--check")
        self.assertEqual(rc, 1, out)
        self.assertIn("extra:   stages/07_demo/open/src/mine.cpp", out)
        check("--check covers the open starter too")

    def expect_error(self, where, words, label):
        rc, out = self.gen()
        self.assertEqual(rc, 1, out)
        self.assertIn(where, out)
        for w in words:
            self.assertIn(w, out)
        self.assertFalse((self.root / "stages" / "07_demo").exists(), "nothing may be written when a file is bad")
        check(f"error case '{label}': {out.strip().splitlines()[0]}")

    def test_errors_name_the_file_and_what_was_expected(self):
        self.manifest({"public": ["include/shardlab/demo/missing.h"]})
        self.expect_error("open_track.json:1:", ["'include/shardlab/demo/missing.h' is not a file"], "missing file")
        self.manifest({"given": ["src/given.cpp"]})
        self.expect_error("open_track.json:1:", ["non-empty 'public' list"], "no public header")
        self.manifest({"public": ["include/shardlab/demo/demo.h"]})
        self.expect_error("include/shardlab/demo/demo.h:3:", ["shardlab/demo/given.h", "does not have"],
                          "a public header including a header the open track lacks")
        self.manifest({"public": ["include/shardlab/demo/demo.h", "include/shardlab/demo/given.h"]})
        header = self.sol / "include/shardlab/demo/demo.h"
        header.write_text(PUBLIC_H.replace("  /// @endcond\n", ""))
        self.expect_error("demo.h:", ["'@cond INTERNAL' without '@endcond'"], "an internal block left open")
        # What the line-based reader cannot read is refused, never guessed (Note [A public surface]).
        refused = [
            ("int count(", "namespace detail {\nint hidden();\n}\nint count(", "a namespace inside a namespace"),
            ("class Wrapper : public Base {", "class Wrapper\n    : public Base {", "without its '{'"),
            ("bool operator==(", "bool operator<(", "an operator with '<'"),
            ("/// A free function: stubbed.", "/* a comment\n over lines */", "a /* comment over several lines"),
            ("struct Options {\n  int width", "struct Options {\n  struct Inner {\n   private:\n    int x;\n  };\n  int width",
             "a nested type with a private section"),
            ("/// A free function: stubbed.\n", "template <typename T>\nT pick(T a);\n", "a template"),
            ("  int width() const { return options_.width; }", "  auto width() const -> int { return 1; }",
             "a trailing return type"),
        ]
        for old, new, words in refused:
            self.assertIn(old, PUBLIC_H)
            header.write_text(PUBLIC_H.replace(old, new, 1))
            self.expect_error("demo.h", [words], words)


if __name__ == "__main__":
    unittest.main(verbosity=2)
