#!/usr/bin/env python3
"""Command-line tests of `shardlab` and `shardlab-run`: bad flags get a clear message and exit code 2."""
import subprocess
import sys

shardlab, launcher = sys.argv[1], sys.argv[2]
failures = 0


def expect(cmd, code, needle):
    global failures
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    ok = p.returncode == code and needle in out
    print(("ok  " if ok else "FAIL"), " ".join(cmd[1:]), "->", p.returncode, "|", out.strip().splitlines()[0] if out.strip() else "")
    if not ok:
        print("     expected exit", code, "and", repr(needle), "in:\n", out)
        failures += 1


expect([shardlab, "train", "--strategy", "nope"], 2, "--strategy expects one of single|naive_ddp; got 'nope'")
expect([shardlab, "train", "--world-size", "0"], 2, "--world-size expects an integer in [1, 64]; got '0'")
expect([shardlab, "train", "--steps", "ten"], 2, "--steps expects an integer")
expect([shardlab, "train", "--model", "resnet"], 2, "--model expects one of mlp|tiny_gpt|edge")
expect([shardlab, "train", "--world-size", "3", "--global-batch", "16"], 2, "must divide by world size")
expect([shardlab, "train", "--strategy", "single", "--world-size", "4"], 2, "runs on one rank")
expect([shardlab, "train", "--bogus", "1"], 2, "unknown flag '--bogus'")
expect([shardlab, "train", "--steps"], 2, "--steps expects a value")
expect([shardlab, "frobnicate"], 2, "unknown command 'frobnicate'")
expect([shardlab, "--help"], 0, "shardlab compare")
expect([launcher, "-n", "x", "--", "true"], 2, "-n")
expect([launcher, "-n", "2", "true"], 2, "--")
expect([launcher, "-n", "2", "--", "sh", "-c", "exit $RANK"], 1, "rank 1")
sys.exit(1 if failures else 0)
