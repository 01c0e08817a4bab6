"""The open track's starter (stages/NN_name/open/), generated from solutions/NN_name by tools/gen_stages.py.

A stage takes part when solutions/NN_name/open_track.json exists:

    {"public": ["include/shardlab/<dir>/<header>.h", ...],   the headers whose public surface the student gets
     "given":  ["include/...", "src/...", ...]}              files copied verbatim (plumbing beyond the concept)

The open starter holds:
  - each public header, reduced to what a user of it sees (Note [A public surface] below);
  - each given file, as it is;
  - src/not_implemented.cpp: one definition per function the public headers declare, each throwing
    NotImplemented("NN", "<Class>::<name>"), so that the starter builds and every test fails naming what is missing;
  - CMakeLists.txt: the stage's library from every .cpp under src/ (the student adds files there).
Every other file of the stage (the solution's sources and internal headers) is the student's to write.
See Note [A public surface] below.
"""
import json
import re
from pathlib import Path

# Note [A public surface]
# A class of a public header that has a private or protected section is one the student designs: its private
# section goes (the state is theirs), and every inline body of a public or protected member function becomes a
# declaration (a body reads private state), defined instead by a stub. Its protected declarations stay: they are
# the contract with the base class. A class or struct with only public members (an options struct, an interface
# with default bodies) is kept as it is, and so is everything else in the header: the contract comments, the
# enums, the free functions' declarations (stubbed). A public header may include only public or given headers of
# its own stage: anything else would not exist in the open starter.
# A public member that is the guided design's own seam rather than a user's call (how a wrapper drives its parts)
# is marked as Doxygen marks internals, between `/// @cond INTERNAL` and `/// @endcond`: those lines are dropped
# (and Doxygen leaves them out of the reference too).
# The parser is line based and expects clang-format's layout (one member per statement, a body opening on the
# declaration's last line); what it cannot read is an error naming the line, never a guess.

MANIFEST = "open_track.json"
ACCESS = re.compile(r"^\s*(public|protected|private)\s*:\s*$")
CLASS_OPEN = re.compile(r"^\s*(class|struct)\s+(\w+)\b[^;]*\{\s*$")
NAMESPACE_OPEN = re.compile(r"^\s*namespace\s+([\w:]+)\s*\{\s*$")
STAGE_INCLUDE = re.compile(r'^\s*#include\s+"(shardlab/([a-z0-9_]+)/[^"]+)"')
LIBRARY = re.compile(r"shardlab_stage_library\(\s*(\w+)\s+SOURCES\s+.*?\s+LINKS\s+([^)]*)\)", re.S)


class OpenError(Exception):
    pass


def code_of(line):
    """The line without its comments: // to the end, and /* */ closed on the same line (string literals kept
    whole). A /* left open stays, for public_surface to refuse."""
    out, quote, i = [], None, 0
    while i < len(line):
        c = line[i]
        if quote:
            out.append(c)
            if c == "\\" and i + 1 < len(line):
                out.append(line[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            out.append(c)
        elif line.startswith("//", i):
            break
        elif line.startswith("/*", i) and "*/" in line[i + 2:]:
            i = line.index("*/", i + 2) + 2
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def braces(code):
    return code.count("{") - code.count("}")


OPENERS, CLOSERS = "(<[{", ")>]}"  # every kind of bracket a declaration nests (templates' angles included)


def matching(text, start):
    """Index of the bracket that closes the one at text[start] (brackets of every kind nest)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in OPENERS:
            depth += 1
        elif text[i] in CLOSERS:
            depth -= 1
            if depth == 0:
                return i
    return -1


def split_top(text, sep):
    """Split at `sep` where no bracket is open."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in OPENERS:
            depth += 1
        elif c in CLOSERS:
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def parse_function(decl):
    """(return type, name, parameters without defaults, qualifiers) of a function declaration, or None when `decl`
    declares no function (a data member, a type, a using)."""
    decl = re.sub(r"\[\[[^\]]*\]\]\s*", "", " ".join(decl.split())).rstrip(";").strip()
    if re.match(r"^(using|typedef|friend|static_assert|template|enum|struct|class|union)\b", decl):
        return None
    op = re.search(r"\boperator\s*([^\w\s(]*)\s*\(", decl)
    if op and (not op.group(1) or re.search(r"[<>]", op.group(1))):
        raise OpenError(f"cannot stub '{decl}': an operator with '<', '>' or '()' in its name; define it inline")
    if re.search(r"\)[\w\s&]*->", decl):
        raise OpenError(f"cannot read '{decl}': a trailing return type; write the return type first")
    depth = 0
    for i, c in enumerate(decl):
        if c == "(" and depth == 0:
            head = decl[:i].rstrip()
            if "=" in re.sub(r"operator\s*\S+$", "", head):  # a variable's initializer (`int k = f(1);`)
                return None
            m = re.search(r"(operator\s*[^\w\s(]+|~?\w+)$", head)
            if not m:
                return None
            close = matching(decl, i)
            if close < 0:
                raise OpenError(f"unbalanced parentheses in '{decl}'")
            params = []
            for p in split_top(decl[i + 1:close], ","):
                p = split_top(p, "=")[0].strip()
                if p and p != "void":
                    params.append(p)
            ret = head[: m.start()].strip()
            ret = re.sub(r"\b(virtual|static|explicit|inline)\s+", "", ret).strip()
            tail = decl[close + 1:]
            if re.search(r"=\s*(delete|default|0)\s*$", tail):
                return None
            tail = re.sub(r"\b(override|final)\b", "", tail)
            return ret, m.group(1), params, " ".join(tail.split())
        if c in OPENERS:
            depth += 1
        elif c in CLOSERS:
            depth -= 1
    return None


def parse_at(decl, where):
    """parse_function, its error placed at `where`."""
    try:
        return parse_function(decl)
    except OpenError as e:
        raise OpenError(f"{where}: {e}")


def has_private_section(lines, start):
    """True when the class opened at lines[start] has a private section (its state: the student's to design)."""
    depth = 0
    for line in lines[start:]:
        code = code_of(line)
        if depth == 1 and ACCESS.match(code) and ACCESS.match(code).group(1) == "private":
            return True
        depth += braces(code)
        if depth <= 0:
            return False
    return False


COND_OPEN = re.compile(r"^\s*///\s*@cond\s+INTERNAL\s*$")
COND_CLOSE = re.compile(r"^\s*///\s*@endcond\s*$")


def drop_internal(lines, where):
    """The lines without the `@cond INTERNAL` ... `@endcond` blocks (Note [A public surface])."""
    out, opened = [], None
    for num, line in enumerate(lines, 1):
        if COND_OPEN.match(line):
            if opened:
                raise OpenError(f"{where}:{num}: '@cond INTERNAL' inside the block opened at line {opened}")
            opened = num
        elif COND_CLOSE.match(line):
            if not opened:
                raise OpenError(f"{where}:{num}: '@endcond' without '@cond INTERNAL'")
            opened = None
        elif not opened:
            out.append(line)
    if opened:
        raise OpenError(f"{where}:{opened}: '@cond INTERNAL' without '@endcond'")
    return out


def public_surface(text, where):
    """Reduce one public header (Note [A public surface]); returns (text, stubs) where stubs is a list of
    (namespace, class or None, (ret, name, params, qualifiers))."""
    lines = drop_internal(text.split("\n"), where)
    for num, line in enumerate(lines, 1):
        if "/*" in code_of(line):
            raise OpenError(f"{where}:{num}: a /* comment over several lines: the open track's reader expects // "
                            f"comments (and /* */ closed on its line)")
    out, stubs, namespace = [], [], None
    i = 0
    depth = 0  # brace depth at the start of lines[i]
    pending = []  # statement lines at namespace depth not yet ended
    while i < len(lines):
        line = lines[i]
        code = code_of(line)
        m = NAMESPACE_OPEN.match(code)
        if m and depth != 0:
            raise OpenError(f"{where}:{i + 1}: a namespace inside a namespace: the open track's reader expects one "
                            f"namespace per header ('namespace a::b {{')")
        if re.match(r"^\s*(class|struct)\s+\w+\b[^;{]*$", code) and depth == 1 and not pending:
            raise OpenError(f"{where}:{i + 1}: a class head without its '{{' on the same line: expected "
                            f"clang-format's layout, got '{code.strip()}'")
        if m and depth == 0:
            namespace = m.group(1)
            out.append(line)
            depth += 1
            i += 1
            continue
        c = CLASS_OPEN.match(code)
        if c and not pending and depth == 1:
            reduce = has_private_section(lines, i)
            i = reduce_class(lines, i, c.group(1), c.group(2), namespace, out, stubs, where, reduce)
            continue
        if pending or (depth == 1 and code.strip() and not code.strip().startswith("#")):
            pending.append(code)
            joined = " ".join(pending)
            if braces(joined) == 0 and joined.rstrip().endswith((";", "}")):
                if joined.lstrip().startswith("template") and (re.search(r"\bprivate\s*:", " ".join(
                        lines[i - len(pending) + 1:i + 1])) or body_brace(joined) is None):
                    raise OpenError(f"{where}:{i + 1}: a template with private state or without a body: the open "
                                    f"track cannot stub it; define it inline, or keep it out of the public headers")
                # An inline definition or a type is kept as it is; a declaration (braces only in a default) stubbed.
                fn = (parse_at(joined, f"{where}:{i + 1}")
                      if body_brace(joined) is None and not joined.rstrip().endswith("}") else None)
                if fn:
                    stubs.append((namespace, None, fn))
                pending = []
        out.append(line)
        depth += braces(code)
        i += 1
    # A dropped block between two blank lines leaves them side by side (clang-format keeps at most one).
    text = re.sub(r"\n(\s*\n){2,}", "\n\n", "\n".join(out))
    return text, stubs


def reduce_class(lines, start, kind, name, namespace, out, stubs, where, reduce=True):
    """Copy the class opened at lines[start] into `out`, reduced (or, with `reduce` false, as it is); stub its
    member functions declared without a body; return the index after its closing line."""
    out.append(lines[start])
    access = "private" if kind == "class" else "public"
    comments, member = [], []  # comment lines waiting for their member; the member's lines so far
    i = start + 1
    while i < len(lines):
        line = lines[i]
        code = code_of(line).strip()
        if not member and code.startswith("}"):  # the class's closing line
            if access != "private" or not reduce:
                out.extend(comments)
            if reduce:
                indent = line[: len(line) - len(line.lstrip())]
                out += [f"{indent} private:", f"{indent}  // Your state: the open track gives none of the solution's members."]
            out.append(line)
            return i + 1
        if not member and ACCESS.match(code):
            if access != "private" or not reduce:
                out.extend(comments)
            comments, access = [], ACCESS.match(code).group(1)
            if access != "private" or not reduce:
                out.append(line)
            i += 1
            continue
        if not member and not code:
            comments.append(line)
            i += 1
            continue
        member.append(line)
        joined = " ".join(code_of(m_) for m_ in member)
        if braces(joined) != 0 or not (joined.rstrip().endswith(";") or joined.rstrip().endswith("}")):
            i += 1
            continue
        if not reduce:
            out.extend(comments + member)
            if access != "private":
                keep_member(member, name, namespace, stubs, f"{where}:{i + 1}")
        elif access != "private":
            out.extend(comments)
            out.extend(reduce_member(member, name, namespace, stubs, f"{where}:{i + 1}"))
        comments, member = [], []
        i += 1
    raise OpenError(f"{where}:{start + 1}: class {name} has no closing brace the parser could find")


def body_brace(text):
    """Index in `text` of a function body's '{': the first one outside every bracket after the parameter list's ')'
    (a default argument's `= {}` is inside the parentheses); None when there is no body."""
    depth = 0
    for k, ch in enumerate(text):
        if ch == "{" and depth == 0 and ")" in text[:k]:
            return k
        if ch in OPENERS:
            depth += 1
        elif ch in CLOSERS:
            depth -= 1
    return None


def nested_type(code, where):
    """True when the member `code` defines a nested type (kept as it is); one with private state is refused."""
    if not re.match(r"^\s*(struct|class|enum|union)\b", code):
        return False
    if re.search(r"\bprivate\s*:", code):
        raise OpenError(f"{where}: a nested type with a private section: the open track's reader reduces only "
                        f"a namespace's classes; move it out of the class")
    return True


def reduce_member(member, cls, namespace, stubs, where):
    """One public or protected member: an inline body becomes a declaration (stubbed); a declaration is stubbed."""
    code = "\n".join(code_of(m).rstrip() for m in member)
    if nested_type(code, where):
        return member  # a nested type: as it is
    brace = body_brace(code)
    if brace is not None:  # a constructor's initializer list: the declaration ends at its ':'
        close = matching(code, code.index("("))
        init = re.search(r"(?<!:):(?!:)", code[close + 1:brace]) if close > 0 else None
        if init:
            brace = close + 1 + init.start()
    fn = parse_at(code if brace is None else code[:brace] + ";", where)
    if brace is not None:
        if fn is None:
            raise OpenError(f"{where}: a body the parser cannot read as a member function's: '{' '.join(code.split())}'")
        member = (code[:brace].rstrip() + ";").split("\n")  # the declaration's lines, cut where the body began
    if fn is not None:
        stubs.append((namespace, cls, fn))
    return member


def keep_member(member, cls, namespace, stubs, where):
    """A member of a class kept as it is: stubbed when it is a function declared without a body."""
    joined = " ".join(code_of(m).strip() for m in member)
    if nested_type(joined, where):
        return
    if body_brace(joined) is None and not joined.rstrip().endswith("}"):
        fn = parse_at(joined, where)
        if fn is not None:
            stubs.append((namespace, cls, fn))


def stub_source(nn, headers, stubs):
    """src/not_implemented.cpp: every stub, grouped by namespace."""
    lines = [
        f"// Generated by tools/gen_stages.py (the open track of stage {nn}): a definition of every function the",
        "// public headers declare, each throwing NotImplemented, so that the starter builds and every test fails",
        "// naming what is missing. Replace them with your own: move a function to your file and delete its stub here.",
    ]
    lines += [f'#include "{h}"' for h in headers] + ['#include "shardlab/core/errors.h"', ""]
    current = None
    for namespace, cls, (ret, name, params, quals) in stubs:
        if namespace != current:
            if current:
                lines += [f"}}  // namespace {current}", ""]
            lines += [f"namespace {namespace} {{", ""]
            current = namespace
        scope = f"{cls}::" if cls else ""
        what = f"{scope}{name}".replace('"', '\\"')
        plist = ", ".join(params)
        throw = f'throw ::shardlab::NotImplemented("{nn}", "{what}");'
        if cls and name == f"~{cls}":
            lines += [f"{scope}{name}() = default;", ""]
            continue
        if cls and name == cls:
            q = f" {quals}" if quals else ""
            lines.append(f"{scope}{name}({plist}){q} {{")
        else:
            q = f" {quals}" if quals else ""
            lines.append(f"auto {scope}{name}({plist}){q} -> {ret} {{")
        lines += [f"  {throw}", "}", ""]
    if current:
        lines.append(f"}}  // namespace {current}")
    return "\n".join(lines) + "\n"


OPEN_CMAKE = """\
# Stage {nn}, the open track: generated by tools/gen_stages.py from solutions/{name}/{manifest}.
# The stage's library is every .cpp under src/: add your own files there (the next build finds them).
# src/not_implemented.cpp holds a stub of every public function; delete each as you define it.
file(GLOB_RECURSE shardlab_open_sources CONFIGURE_DEPENDS ${{CMAKE_CURRENT_SOURCE_DIR}}/src/*.cpp)
shardlab_stage_library({library} SOURCES ${{shardlab_open_sources}} LINKS {links})
set_source_files_properties(src/not_implemented.cpp PROPERTIES COMPILE_OPTIONS -Wno-unused-parameter)
"""


def build_open(root, sol, nn):
    """{relpath under open/: (bytes, mode)} for solutions/<sol.name>, or {} when it has no open track."""
    manifest = sol / MANIFEST
    if not manifest.is_file():
        return {}
    where = manifest.relative_to(root).as_posix()
    try:
        spec = json.loads(manifest.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise OpenError(f"{where}:{e.lineno}: expected JSON, got: {e.msg}")
    if not isinstance(spec, dict) or set(spec) - {"public", "given"} or not spec.get("public"):
        raise OpenError(f"{where}:1: expected an object with a non-empty 'public' list and an optional 'given' "
                        f"list, got keys {sorted(spec) if isinstance(spec, dict) else type(spec).__name__}")
    public, given = spec["public"], spec.get("given", [])
    for rel in public + given:
        if not (sol / rel).is_file():
            raise OpenError(f"{where}:1: '{rel}' is not a file of solutions/{sol.name}")
    stage_dir = Path(public[0]).parts[2] if len(Path(public[0]).parts) > 2 else ""
    present = {Path(p).relative_to("include").as_posix() for p in public + given if p.startswith("include/")}
    files, stubs = {}, []
    for rel in public + given:
        path = sol / rel
        text = path.read_text(encoding="utf-8")
        for num, line in enumerate(text.split("\n"), 1):
            inc = STAGE_INCLUDE.match(line)
            if inc and inc.group(2) == stage_dir and inc.group(1) not in present:
                raise OpenError(f"{sol.relative_to(root).as_posix()}/{rel}:{num}: includes {inc.group(1)}, which "
                                f"the open track does not have: expected only headers listed in {where}")
        if rel in public:
            text, found = public_surface(text, f"{sol.relative_to(root).as_posix()}/{rel}")
            stubs += found
        files[rel] = (text.encode("utf-8"), path.stat().st_mode & 0o7777)
    headers = [Path(p).relative_to("include").as_posix() for p in public]
    files["src/not_implemented.cpp"] = (stub_source(nn, headers, stubs).encode("utf-8"), 0o644)
    cmake = (sol / "CMakeLists.txt").read_text(encoding="utf-8")
    lib = LIBRARY.search(cmake)
    if not lib:
        raise OpenError(f"solutions/{sol.name}/CMakeLists.txt:1: expected 'shardlab_stage_library(<name> SOURCES "
                        f"... LINKS ...)', got none")
    files["CMakeLists.txt"] = (OPEN_CMAKE.format(nn=nn, name=sol.name, manifest=MANIFEST, library=lib.group(1),
                                                 links=" ".join(lib.group(2).split())).encode("utf-8"), 0o644)
    return files
