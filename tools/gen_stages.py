#!/usr/bin/env python3
"""Generate the student starters stages/NN_name from the reference solutions/NN_name.

Every directory solutions/NN_name (NN = two digits) is copied to stages/NN_name.
In C++ sources (.h .hpp .cpp .cc) each marked region

    <indent>// BEGIN SOLUTION(NN): <what>
    ...reference code...
    <indent>// END SOLUTION

is replaced by exactly two lines at the BEGIN line's indentation:

    <indent>// TODO(stageNN): <what>
    <indent>throw ::shardlab::NotImplemented("NN", "<what>");

NotImplemented (shardlab/core/errors.h, which a file with such a region must
include) is no std::logic_error, so a test that expects a user check cannot pass
on a starter; its message is "not implemented: stage NN \u2014 <what>".

`// BEGIN SOLUTION(NN, keep): <what>` leaves only the TODO line (no throw), for
regions in void functions whose absence still compiles and merely fails tests.
NN in a marker must equal the directory's NN; regions may not nest; <what> may
not be empty. Everything outside regions is copied verbatim (binary files as-is,
permissions included). stages/NN_name/GENERATED.md records the provenance.

A stage with solutions/NN_name/open_track.json also gets its open-track starter, stages/NN_name/open/ (tools/gen_open.py
says what it holds); the manifest itself is not copied.

    tools/gen_stages.py            regenerate all stages in place
    tools/gen_stages.py --check    exit 1 if stages/ differs from what would be generated
"""
import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_open  # noqa: E402  (the open track: stages/NN_name/open/)

SOURCE_EXTS = {".h", ".hpp", ".cpp", ".cc"}
STAGE_DIR = re.compile(r"^(\d\d)_.+$")
ANY_MARKER = re.compile(r"^\s*//\s*(BEGIN|END) SOLUTION\b")
BEGIN = re.compile(r"^(\s*)//\s*BEGIN SOLUTION\(\s*(\d+)\s*(,\s*keep\s*)?\):(.*)$")
END = re.compile(r"^\s*//\s*END SOLUTION\s*$")
ERRORS_INCLUDE = '"shardlab/core/errors.h"'
BEGIN_FORM = "'// BEGIN SOLUTION(NN): <what>' or '// BEGIN SOLUTION(NN, keep): <what>'"
COMMENT = re.compile(r"^(\s*)//\s?(.*)$")
COLUMN_LIMIT = 120  # .clang-format's: a longer BEGIN line is wrapped onto the next line by the formatter
GENERATED_MD = """# Generated files: do not edit

This directory was generated from `solutions/{name}` by `tools/gen_stages.py`.
Do not edit it by hand: change `solutions/{name}` and regenerate with `tools/gen_stages.py`
(`tools/gen_stages.py --check` tells whether stages/ is up to date).
"""


class GenError(Exception):
    pass


def wrapped_begin(line, following):
    """True when `following` reads as the formatter's continuation of the BEGIN line `line`: a plain comment at the
    same indent, going on mid-sentence (not a capitalised word such as "Offsets"; an acronym or a single capital may
    still continue it), whose first word would not have fit on the line (clang-format
    wraps a comment line past the column limit, and the wrapped words would then vanish into the solution region,
    leaving the TODO title cut mid-sentence)."""
    b, c = BEGIN.match(line), COMMENT.match(following or "")
    if not b or not c or c.group(1) != b.group(1) or not c.group(2) or BEGIN.match(following) or END.match(following):
        return False
    word = c.group(2).split()[0]
    if len(word) > 1 and word[0].isupper() and word[1:].islower():  # "Offsets ...": a sentence of its own, the
        return False                                                # region's first comment ("HSDP" or "N" may not be)
    return len(line.rstrip()) + 1 + len(c.group(2).split()[0]) > COLUMN_LIMIT


def strip_regions(text, nn, where):
    """Return (new_text, regions_replaced) for one source file; raise GenError on bad markers."""
    out, regions, open_at = [], 0, None  # open_at: (line number, indent, what, keep, eol)
    throws = False
    lines = text.split("\n")
    for num, raw in enumerate(lines, 1):
        eol = "\r" if raw.endswith("\r") else ""
        line = raw[: len(raw) - len(eol)]
        m = BEGIN.match(line)
        if m:
            if open_at:
                raise GenError(f"{where}:{num}: nested BEGIN SOLUTION: expected '// END SOLUTION' "
                               f"for the region opened at line {open_at[0]}, got another BEGIN")
            indent, stage, keep, what = m.group(1), m.group(2), m.group(3), m.group(4).strip()
            if int(stage) != int(nn):
                raise GenError(f"{where}:{num}: marker says stage {stage}, expected {nn} "
                               f"(the stage number of the directory)")
            if not what:
                raise GenError(f"{where}:{num}: empty <what> in BEGIN SOLUTION marker: expected "
                               f"{BEGIN_FORM} with a description, got '{line.strip()}'")
            following = lines[num].rstrip("\r") if num < len(lines) else ""
            if wrapped_begin(line, following):
                raise GenError(f"{where}:{num}: the BEGIN SOLUTION line was wrapped by the formatter (its "
                               f"{COLUMN_LIMIT}-column limit): line {num + 1}, '{following.strip()}', continues it "
                               f"and would vanish from the TODO title; expected a <what> that fits on one line")
            open_at = (num, indent, what, bool(keep), eol)
        elif END.match(line):
            if not open_at:
                raise GenError(f"{where}:{num}: '// END SOLUTION' without a preceding BEGIN SOLUTION")
            _, indent, what, keep, beol = open_at
            out.append(f"{indent}// TODO(stage{nn}): {what}{beol}")
            if not keep:
                lit = what.replace("\\", "\\\\").replace('"', '\\"')  # what, as a C++ string literal
                out.append(f'{indent}throw ::shardlab::NotImplemented("{nn}", "{lit}");{beol}')
                throws = True
            regions, open_at = regions + 1, None
        elif ANY_MARKER.match(line):
            raise GenError(f"{where}:{num}: malformed marker: expected {BEGIN_FORM} "
                           f"or '// END SOLUTION', got '{line.strip()}'")
        elif not open_at:
            out.append(raw)
    if open_at:
        raise GenError(f"{where}:{open_at[0]}: BEGIN SOLUTION without END: expected "
                       f"'// END SOLUTION' before the end of the file")
    if throws and ERRORS_INCLUDE not in text:
        raise GenError(f"{where}:1: a region that throws needs the file to include "
                       f"<{ERRORS_INCLUDE[1:-1]}> (NotImplemented); expected '#include {ERRORS_INCLUDE}', got none")
    return "\n".join(out), regions


def build_stage(root, sol):
    """Return ({relpath: (bytes, mode)}, regions) for solutions/<sol.name>."""
    nn = STAGE_DIR.match(sol.name).group(1)
    files, regions = {}, 0
    for path in sorted(p for p in sol.rglob("*") if p.is_file()):
        rel = path.relative_to(sol).as_posix()
        if rel == gen_open.MANIFEST:
            continue
        data, mode = path.read_bytes(), path.stat().st_mode & 0o7777
        if path.suffix in SOURCE_EXTS:
            where = path.relative_to(root).as_posix()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise GenError(f"{where}:1: expected UTF-8 text, got undecodable bytes ({e.reason})")
            text, n = strip_regions(text, nn, where)
            data, regions = text.encode("utf-8"), regions + n
        files[rel] = (data, mode)
    files["GENERATED.md"] = (GENERATED_MD.format(name=sol.name).encode("utf-8"), 0o644)
    try:
        files.update({f"open/{rel}": v for rel, v in gen_open.build_open(root, sol, nn).items()})
    except gen_open.OpenError as e:
        raise GenError(str(e))
    return files, regions


def write_stage(dest, files):
    """Make directory dest hold exactly `files`; unchanged files are not rewritten."""
    for rel, (data, mode) in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.is_file() and target.read_bytes() == data):
            target.write_bytes(data)
        os.chmod(target, mode)
    if dest.is_dir():
        for path in sorted(dest.rglob("*"), reverse=True):  # children before parents
            rel = path.relative_to(dest).as_posix()
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            elif rel not in files:
                path.unlink()


def compare_trees(fresh, current, label):
    """List problems of `current` (the checked-in stage) against `fresh` (just generated)."""
    def listing(d):
        return {p.relative_to(d).as_posix() for p in d.rglob("*") if not p.is_dir()} if d.is_dir() else set()
    want, have = listing(fresh), listing(current)
    problems = [f"missing: {label}/{r}" for r in sorted(want - have)]
    problems += [f"extra:   {label}/{r}" for r in sorted(have - want)]
    for r in sorted(want & have):
        a, b = fresh / r, current / r
        if not filecmp.cmp(a, b, shallow=False):
            problems.append(f"stale:   {label}/{r}")
        elif (a.stat().st_mode ^ b.stat().st_mode) & 0o111:
            problems.append(f"stale:   {label}/{r} (executable bit differs)")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that stages/ is up to date")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="project root (default: parent of this script's directory)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    sols = sorted(d for d in (root / "solutions").glob("*") if d.is_dir() and STAGE_DIR.match(d.name))
    stages_dir = root / "stages"
    for d in sorted(stages_dir.glob("*")) if stages_dir.is_dir() else []:
        if d.is_dir() and not (root / "solutions" / d.name).is_dir():
            print(f"warning: stages/{d.name} has no solutions/{d.name}; left alone", file=sys.stderr)

    built, errors = {}, []
    for sol in sols:  # build everything in memory first: nothing is written if any file is bad
        try:
            built[sol.name] = build_stage(root, sol)
        except GenError as e:
            errors.append(str(e))
    if errors:
        print("\n".join(f"error: {e}" for e in errors), file=sys.stderr)
        return 1

    if args.check:
        problems = []
        with tempfile.TemporaryDirectory() as tmp:
            for name, (files, _) in built.items():
                write_stage(Path(tmp) / name, files)
                problems += compare_trees(Path(tmp) / name, stages_dir / name, f"stages/{name}")
        if problems:
            print("stages/ is stale: run tools/gen_stages.py\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"stages/ is up to date ({len(built)} stage(s))")
        return 0

    for name, (files, regions) in built.items():
        write_stage(stages_dir / name, files)
        print(f"stages/{name}: {regions} region(s) replaced, {len(files)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
