#!/usr/bin/env python3
"""Runs `shardlab train --trace DIR` as real processes and checks the Chrome traces it writes: each file parses,
holds a forward, backward and optimizer span per step on the compute track, one wait span per synchronized
backward nested inside its backward, and one comm span per collective of the run, on lanes whose spans never
overlap. Usage: check_trace.py SHARDLAB"""
import json
import os
import subprocess
import sys
import tempfile

shardlab = sys.argv[1]
steps, world = 4, 2
errors = []
with tempfile.TemporaryDirectory() as tmp:
    trace_dir, report_path = os.path.join(tmp, "traces"), os.path.join(tmp, "report.json")
    cmd = [shardlab, "train", "--strategy", "bucketed_ddp", "--world-size", str(world), "--model", "tiny_gpt",
           "--steps", str(steps), "--global-batch", "8", "--bucket-cap-kb", "32", "--first-bucket-kb", "16",
           "--trace", trace_dir, "--json", report_path]
    print("running:", " ".join(cmd), flush=True)
    if subprocess.run(cmd, timeout=300).returncode != 0:
        sys.exit("shardlab train failed")
    report = json.load(open(report_path))
    buckets = report["buckets"]
    for rank in range(world):
        path = os.path.join(trace_dir, f"rank{rank}.trace.json")
        events = json.load(open(path))["traceEvents"]  # must parse
        spans = [e for e in events if e.get("ph") == "X"]
        if any(e["pid"] != rank for e in events):
            errors.append(f"{path}: an event with another pid than {rank}")
        compute = [e for e in spans if e["cat"] == "compute"]
        waits = [e for e in spans if e["cat"] == "wait"]
        comm = [e for e in spans if e["cat"] == "comm"]
        for name in ("forward", "backward", "optimizer"):
            got = sorted(e["args"]["step"] for e in compute if e["name"] == name)
            if got != list(range(steps)):
                errors.append(f"rank {rank}: {name} spans for steps {got}, expected {list(range(steps))}")
        backward = [e for e in compute if e["name"] == "backward"]
        for w in waits:
            if not any(b["ts"] <= w["ts"] and w["ts"] + w["dur"] <= b["ts"] + b["dur"] + 1e-3 for b in backward):
                errors.append(f"rank {rank}: wait span at {w['ts']} is not inside a backward span")
        if len(waits) != steps:
            errors.append(f"rank {rank}: {len(waits)} wait spans, expected one per step ({steps})")
        # every collective of the run: setup (the ranks' models compared by all-gathers, the broadcasts) + one rebuild
        # broadcast + one all-reduce per bucket per step
        reduces = [e for e in comm if e["name"] == "all_reduce"]
        broadcasts = [e for e in comm if e["name"] in ("broadcast", "all_gather")]
        if len(reduces) != buckets * steps:
            errors.append(f"rank {rank}: {len(reduces)} all_reduce spans, expected {buckets} x {steps}")
        if len(broadcasts) != report["setup_collectives"]:
            errors.append(f"rank {rank}: {len(broadcasts)} broadcast and all_gather spans, report says "
                          f"{report['setup_collectives']} setup collectives")
        lanes = {}
        for e in sorted(comm, key=lambda e: e["ts"]):
            if e["tid"] in lanes and e["ts"] < lanes[e["tid"]] - 1e-3:
                errors.append(f"rank {rank}: overlapping spans on comm lane {e['tid']}")
            lanes[e["tid"]] = e["ts"] + e["dur"]
        if sum(e["args"]["bytes"] for e in reduces) != report["bytes_per_step"] * steps and rank == 0:
            errors.append("rank 0: all_reduce bytes in the trace differ from the report")
        first_bucket_before_end = sum(
            1 for b in backward for e in reduces if b["ts"] <= e["ts"] < b["ts"] + b["dur"])
        if first_bucket_before_end < steps:
            errors.append(f"rank {rank}: only {first_bucket_before_end} all-reduces started inside a backward span; "
                          f"expected at least one per step ({steps}): buckets must launch during backward")
        print(f"rank {rank}: {len(spans)} spans ({len(compute)} compute, {len(waits)} waits, {len(comm)} comm on "
              f"{len(lanes)} lanes); {first_bucket_before_end} all-reduces started inside a backward span")
if errors:
    sys.exit("\n".join(errors))
print("ok")
