#!/usr/bin/env python3
"""Tests for tools/gen_stages.py: run as `python3 tests/common/test_gen_stages.py`.

Each test builds a tiny fake project (solutions/07_demo) in a temporary directory and runs
the generator on it with --root, as a subprocess, exactly as a user would.
"""
import os
import stat
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gen_stages.py"

SOLUTION_CPP = """\
#include "shardlab/core/errors.h"

int add(int a, int b) {
    // BEGIN SOLUTION(07): add two ints
    int s = a + b;
    return s;
    // END SOLUTION
}

void fill(float* p, int n) {
  // BEGIN SOLUTION(07, keep): fill with ones
  for (int i = 0; i < n; ++i) p[i] = 1.0f;
  // END SOLUTION
}
// trailing line without newline"""

EXPECTED_CPP = """\
#include "shardlab/core/errors.h"

int add(int a, int b) {
    // TODO(stage07): add two ints
    throw ::shardlab::NotImplemented("07", "add two ints");
}

void fill(float* p, int n) {
  // TODO(stage07): fill with ones
}
// trailing line without newline"""

BINARY = bytes(range(256)) + b"// BEGIN SOLUTION(07): not a source file\n"


def check(what):
    print(f"  checked: {what}")


class GenStagesTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.sol = self.root / "solutions" / "07_demo"
        (self.sol / "src").mkdir(parents=True)
        (self.sol / "src" / "demo.cpp").write_text(SOLUTION_CPP, encoding="utf-8")
        (self.sol / "README.md").write_text("// BEGIN SOLUTION(07): only .h/.hpp/.cpp/.cc are edited\n")
        (self.sol / "blob.bin").write_bytes(BINARY)
        (self.sol / "run.sh").write_text("#!/bin/sh\necho hi\n")
        os.chmod(self.sol / "run.sh", 0o755)
        self.stage = self.root / "stages" / "07_demo"

    def tearDown(self):
        self._tmp.cleanup()

    def gen(self, *args):
        r = subprocess.run([sys.executable, str(SCRIPT), "--root", str(self.root), *args],
                           capture_output=True, text=True, encoding="utf-8")
        return r.returncode, r.stdout + r.stderr

    def test_generates_expected_output(self):
        rc, out = self.gen()
        self.assertEqual(rc, 0, out)
        self.assertIn("stages/07_demo: 2 region(s) replaced", out)
        check("exit 0 and one summary line per stage with the region count")
        self.assertEqual((self.stage / "src" / "demo.cpp").read_text(encoding="utf-8"), EXPECTED_CPP)
        check("normal region -> TODO + throw (em dash), keep region -> TODO only, rest verbatim")
        self.assertEqual((self.stage / "README.md").read_text(), (self.sol / "README.md").read_text())
        self.assertEqual((self.stage / "blob.bin").read_bytes(), BINARY)
        check("non-source and binary files copied byte for byte")
        self.assertTrue(os.stat(self.stage / "run.sh").st_mode & stat.S_IXUSR)
        check("permissions copied (executable bit)")
        gen_md = (self.stage / "GENERATED.md").read_text()
        self.assertIn("solutions/07_demo", gen_md)
        self.assertIn("tools/gen_stages.py", gen_md)
        check("GENERATED.md names the solution and the generator")
        self.assertEqual(self.gen("--check"), (0, "stages/ is up to date (1 stage(s))\n"))
        check("--check exits 0 right after generation")

    def test_check_detects_stale_missing_and_extra(self):
        rc, out = self.gen("--check")
        self.assertEqual(rc, 1)
        self.assertIn("missing: stages/07_demo/src/demo.cpp", out)
        check("--check reports missing files when stages/ was never generated")
        self.assertEqual(self.gen()[0], 0)
        (self.stage / "extra.txt").write_text("stray\n")
        (self.sol / "src" / "demo.cpp").write_text(SOLUTION_CPP.replace("a + b", "b + a"))
        rc, out = self.gen("--check")
        self.assertEqual(rc, 1, out)
        self.assertIn("stages/ is stale: run tools/gen_stages.py", out)
        self.assertIn("extra:   stages/07_demo/extra.txt", out)
        self.assertNotIn("stale:   stages/07_demo/src/demo.cpp", out)
        check("--check flags an extra file; a change inside a region does not make the stage stale")
        (self.sol / "src" / "demo.cpp").write_text(SOLUTION_CPP.replace("#include", "#include <vector>\n#include"))
        rc, out = self.gen("--check")
        self.assertEqual(rc, 1, out)
        self.assertIn("stale:   stages/07_demo/src/demo.cpp", out)
        check("--check flags a stale file")
        self.assertEqual(self.gen()[0], 0)
        self.assertFalse((self.stage / "extra.txt").exists())
        self.assertEqual(self.gen("--check")[0], 0)
        check("regeneration deletes the extra file and --check passes again")

    def test_orphan_stage_is_warned_and_left_alone(self):
        orphan = self.root / "stages" / "09_orphan"
        orphan.mkdir(parents=True)
        (orphan / "keep.txt").write_text("mine\n")
        rc, out = self.gen()
        self.assertEqual(rc, 0, out)
        self.assertIn("warning: stages/09_orphan", out)
        self.assertEqual((orphan / "keep.txt").read_text(), "mine\n")
        check("stage directory without a solution is warned about and left alone")

    def expect_error(self, body, line, words, label):
        (self.sol / "src" / "demo.cpp").write_text(body)
        rc, out = self.gen()
        self.assertEqual(rc, 1, out)
        self.assertIn(f"solutions/07_demo/src/demo.cpp:{line}:", out)
        for w in words:
            self.assertIn(w, out)
        self.assertFalse(self.stage.exists(), "nothing may be written when a file is bad")
        check(f"error case '{label}' exits 1 with file:{line}: {out.strip().splitlines()[0]}")

    def test_errors(self):
        self.expect_error("int x;\n// BEGIN SOLUTION(07): a\nint y;\n", 2, ["without END"],
                          "BEGIN without END")
        self.expect_error("// BEGIN SOLUTION(07): a\n  // BEGIN SOLUTION(07): b\n// END SOLUTION\n", 2,
                          ["nested", "line 1"], "nested BEGIN")
        self.expect_error("int x;\n\n  // END SOLUTION\n", 3, ["without a preceding BEGIN"],
                          "END without BEGIN")
        self.expect_error("// BEGIN SOLUTION(08): a\n// END SOLUTION\n", 1, ["stage 08", "expected 07"],
                          "wrong stage number")
        self.expect_error("x;\n// BEGIN SOLUTION(07):   \n// END SOLUTION\n", 2, ["empty <what>"],
                          "empty <what>")
        self.expect_error("// BEGIN SOLUTION 07: a\n// END SOLUTION\n", 1, ["malformed marker"],
                          "malformed marker")
        self.expect_error("int f() {\n  // BEGIN SOLUTION(07): a\n  return 1;\n  // END SOLUTION\n}\n", 1,
                          ["shardlab/core/errors.h", "NotImplemented"],
                          "a throwing region in a file without the errors header")
        # A BEGIN line the formatter wrapped: the title would be cut mid-sentence and its end vanish into the region.
        long_what = "x" * 70 + " and the rest of the"  # a 116-column line: the next word did not fit
        self.expect_error(f"  // BEGIN SOLUTION(07): {long_what}\n  // sentence\n  int y;\n  // END SOLUTION\n", 1,
                          ["wrapped by the formatter", "line 2", "'// sentence'"], "a wrapped BEGIN line")
        self.expect_error(f"  // BEGIN SOLUTION(07): {long_what}\n  // HSDP2\n  int y;\n  // END SOLUTION\n", 1,
                          ["wrapped by the formatter"], "a wrapped BEGIN line going on with an acronym")


if __name__ == "__main__":
    unittest.main(verbosity=2)
