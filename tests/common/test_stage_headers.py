#!/usr/bin/env python3
"""Checks Note [A starter's headers] (cmake/ShardLabStage.cmake) on a configured build.

Every header that differs between solutions/NN/include and stages/NN/include must be found first through a
forwarder under <build>/stage_headers/NN, which #includes the real header of the tree the stage is built from (per
SHARDLAB_STARTER_STAGES in the build's cache), by its absolute path. A copy instead of a forwarder compiles a stale
header when the student edits it during a build, and the compiler's errors name a file under build/.

usage: test_stage_headers.py SOURCE_DIR BUILD_DIR
"""
import pathlib
import re
import sys


def main() -> int:
    src, build = (pathlib.Path(a).resolve() for a in sys.argv[1:3])
    cache = (build / "CMakeCache.txt").read_text()
    m = re.search(r"^SHARDLAB_STARTER_STAGES:[A-Z]+=(.*)$", cache, re.M)
    starter = set(m.group(1).split(";")) if m and m.group(1) else set()
    errors, checked = [], 0
    for sol in sorted((src / "solutions").iterdir()):
        stage = src / "stages" / sol.name
        if not (sol / "include").is_dir() or not (stage / "include").is_dir():
            continue
        from_starter = "all" in starter or sol.name[:2] in starter
        tree = (stage if from_starter else sol) / "include"
        for header in sorted((sol / "include").rglob("*.h")):
            rel = header.relative_to(sol / "include")
            other = stage / "include" / rel
            if not other.exists() or other.read_bytes() == header.read_bytes():
                continue
            fwd = build / "stage_headers" / sol.name / rel
            checked += 1
            if not fwd.exists():
                errors.append(f"{rel}: differs between the trees, but {fwd} is missing")
                continue
            includes = re.findall(r'^#include "([^"]+)"', fwd.read_text(), re.M)
            want = str(tree / rel)
            if includes != [want]:
                errors.append(f"{fwd}: expected a forwarder including exactly \"{want}\" "
                              f"(stage {sol.name} from the {'starter' if from_starter else 'solution'}); "
                              f"found includes {includes} in:\n{fwd.read_text()}")
    for e in errors:
        print("FAIL:", e)
    print(f"test_stage_headers: {checked} differing header(s) checked, {len(errors)} problem(s)")
    return 1 if errors or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
