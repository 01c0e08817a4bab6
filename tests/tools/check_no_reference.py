#!/usr/bin/env python3
"""`shardlab train --reference none`: the ranks train alone, as they do beside one device.

Usage: check_no_reference.py SHARDLAB ARGS...   (ARGS: a train command line without --json and --reference)

Trains ARGS twice, with --reference none and with the default (single), and checks that:
  - the ranks' losses, traffic and memory figures are the same bit for bit (the reference changes nothing of theirs);
  - the run without a reference says so: `reference` "none", no reference losses, and null where a figure would
    compare with one device (max_param_diff, final_loss, reference_final_loss), so nothing reads as a perfect match;
  - its printed report has no reference column and says that nothing was compared.
"""
import json
import os
import subprocess
import sys
import tempfile

shardlab, args = sys.argv[1], sys.argv[2:]
errors = []


def train(extra, path):
    cmd = [shardlab, "train", *args, *extra, "--json", path]
    print("running:", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"shardlab train exited with {p.returncode}:\n{p.stdout}{p.stderr}")
    with open(path) as f:
        return json.load(f), p.stdout


with tempfile.TemporaryDirectory() as tmp:
    alone, printed = train(["--reference", "none"], os.path.join(tmp, "none.json"))
    beside, _ = train([], os.path.join(tmp, "single.json"))

print("losses without a reference", alone["losses"], "beside one device", beside["losses"])
for key in ("losses", "collectives_per_step", "bytes_per_step", "bytes_per_step_theory", "peak_param_bytes",
            "peak_grad_bytes", "setup_collectives"):
    if alone[key] != beside[key]:
        errors.append(f"{key}: {alone[key]} without a reference, {beside[key]} beside one device")
if beside["reference"] != "single" or not beside["reference_losses"]:
    errors.append(f"the default run has reference {beside['reference']!r}, {len(beside['reference_losses'])} losses")
expected = {"reference": "none", "reference_losses": [], "max_param_diff": None, "final_loss": None,
            "reference_final_loss": None}
for key, value in expected.items():
    if alone.get(key, "missing") != value:
        errors.append(f"--reference none: expected {key} {value!r}; got {alone.get(key, 'missing')!r}")
for needle, present in (("no single-device reference (--reference none)", True), ("reference   |difference|", False),
                        ("max parameter difference", False)):
    if (needle in printed) != present:
        errors.append(f"the printed report {'lacks' if present else 'has'} {needle!r}:\n{printed}")
for e in errors:
    print("FAIL", e)
print("ok" if not errors else f"{len(errors)} failed")
sys.exit(1 if errors else 0)
