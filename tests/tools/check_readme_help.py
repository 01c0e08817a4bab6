#!/usr/bin/env python3
"""The README's section on the tool and the tools' --help agree: the same commands, the same flags.

Reads `shardlab --help`, `shardlab COMMAND --help` for every command it lists, and `shardlab-run --help`, and the
README's section "The `shardlab` tool". Fails, naming them, on:
  - a command of --help the section never shows, or a `shardlab X` in the README that is no command;
  - a flag of any --help the section never names, or a flag in the section that no --help has.
"""
import re
import subprocess
import sys

shardlab, launcher, readme = sys.argv[1], sys.argv[2], sys.argv[3]


def help_text(*cmd):
    p = subprocess.run(list(cmd) + ["--help"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL {' '.join(cmd)} --help exited with {p.returncode}:\n{p.stdout}{p.stderr}")
    return p.stdout


def flags_of(text):
    """The long flags a CLI11 help lists: the first word of an option's line, "-n,--nproc-per-node INT" too."""
    flags = set()
    for line in text.splitlines():
        words = line.split()
        if words and words[0].startswith("-"):
            flags |= {f for f in re.split(r"[,:=]", words[0]) if f.startswith("--")}
    return flags - {"--help"}


def commands_of(text):
    lines = text.splitlines()
    start = lines.index("Subcommands:") + 1 if "Subcommands:" in lines else len(lines)
    commands = []
    for line in lines[start:]:
        if not line.strip():
            break
        commands.append(line.split()[0])
    return commands


top = help_text(shardlab)
commands = commands_of(top)
helps = {"shardlab": flags_of(top), "shardlab-run": flags_of(help_text(launcher))}
for c in commands:
    helps["shardlab " + c] = flags_of(help_text(shardlab, c))

with open(readme) as f:
    text = f.read()
match = re.search(r"^## The `shardlab` tool\n(.*?)(?=^## )", text, re.S | re.M)
if not match:
    sys.exit("FAIL the README has no section '## The `shardlab` tool'")
section = match.group(1)
section_flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", section)) - {"--help"}
shown = set(re.findall(r"(?:`|bin/)shardlab ([a-z][a-z-]*)", text))

failures = []
print("commands in shardlab --help:", " ".join(commands))
if not commands:
    failures.append("shardlab --help lists no commands (under 'Subcommands:')")
for c in commands:
    if c not in shown:
        failures.append(f"command '{c}' of shardlab --help is never shown as `shardlab {c}` in the README")
for c in sorted(shown - set(commands)):
    failures.append(f"the README shows `shardlab {c}`, which shardlab --help does not list")
every_flag = set().union(*helps.values())
for where, flags in sorted(helps.items()):
    print(f"{where} --help: {len(flags)} flags")
    for flag in sorted(flags - section_flags):
        failures.append(f"{flag} of `{where} --help` is not in the README's section on the tool")
for flag in sorted(section_flags - every_flag):
    failures.append(f"the README's section on the tool names {flag}, which no --help lists")
for f in failures:
    print("FAIL", f)
print(f"{len(section_flags)} flags in the README's section, {len(every_flag)} in the --help texts;",
      "they agree" if not failures else f"{len(failures)} differences")
sys.exit(1 if failures else 0)
