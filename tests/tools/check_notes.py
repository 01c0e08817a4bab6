#!/usr/bin/env python3
"""Every `Note [Name]` written in the sources is listed in docs/architecture.md, under the source that defines it,
and every Note listed there exists.

A Note is defined by a comment that starts with `Note [Name]` (after //, ///, or #); it is referred to elsewhere
as `See Note [Name]`. Usage: check_notes.py <project root>
"""
import re
import sys
from pathlib import Path

SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".py", ".cmake", ".txt", ""}
root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
# Walked, not asked of git: the libtorch 2.6 line runs the tests on a copy without .git.
files = [str(p.relative_to(root)) for d in ("common", "solutions", "tools", "tests", "cmake", ".ci")
         for p in sorted((root / d).rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
definition = re.compile(r"^\s*(?://+|#)\s*Note \[([^\]]+)\]")
defined, underlined = {}, {}
for f in files:
    path = root / f
    if not path.is_file():
        continue
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        continue
    for n, line in enumerate(lines, 1):
        m = definition.match(line)
        if m:
            defined.setdefault(m.group(1), f"{f}:{n}")
            if n < len(lines) and "~~~" in lines[n]:  # the Note itself, underlined; elsewhere a line may start with it
                underlined.setdefault(m.group(1), f"{f}:{n}")
doc = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
listed = set(re.findall(r"Note \[([^\]]+)\]", re.sub(r"\s+", " ", doc)))
# Each source named in the list, "(file.cpp)", is where the Notes listed since the previous one are defined.
start, end = doc.find("is listed here"), doc.find("- **Headers are contracts.**")
if start < 0 or end < start:
    sys.exit("check_notes: docs/architecture.md lost the list of Notes (\"is listed here\" ... \"- **Headers are "
             "contracts.**\"); the check cannot tell under which source each Note is filed")
in_list = re.sub(r"\s+", " ", doc[start:end])
pending, misfiled = [], []
for tok in re.finditer(r"Note \[([^\]]+)\]|\(([\w./-]+\.(?:cpp|h|cmake|py))\)", in_list):
    if tok.group(1):
        pending.append(tok.group(1))
        continue
    for name in pending:
        where = underlined.get(name, defined.get(name, ""))
        if where and Path(where.split(":")[0]).name != Path(tok.group(2)).name:
            misfiled.append(f"check_notes: docs/architecture.md files Note [{name}] under {tok.group(2)}; it is "
                            f"defined in {where}")
    pending = []
misfiled += [f"check_notes: docs/architecture.md lists Note [{name}] after the last source it names; say where it is "
             f"defined" for name in pending]
missing = sorted(set(defined) - listed)
stale = sorted(n for n in listed - set(defined) if n != "Name")
for name in missing:
    print(f"check_notes: Note [{name}] ({defined[name]}) is not listed in docs/architecture.md")
for name in stale:
    print(f"check_notes: docs/architecture.md lists Note [{name}], which no source defines")
for line in misfiled:
    print(line)
print(f"check_notes: {len(defined)} Notes defined, {len(listed - {'Name'})} listed")
sys.exit(1 if missing or stale or misfiled else 0)
