#!/usr/bin/env python3
"""Every JSON the tool writes, read back with Python's json module, with its documented keys (issue 21):
  - `shardlab train --json`: one report, every key of tools/shardlab/driver.cpp's report_to_json, in that order;
  - `shardlab bench --section ddp --out P`: P.json with the sections, the PyTorch DDP peer's figures (read back by
    the tool from torch_ddp.py's JSON where python3 has torch) and one report per strategy;
  - `shardlab bench --section reduce_scatter --out P`: the probes' rows at 2, 3 and 4 ranks.
Usage: check_bench_json.py SHARDLAB"""
import json
import os
import subprocess
import sys
import tempfile

SHARDLAB = sys.argv[1]
errors = []

# The keys of one run's report, in the order they are written (README, notebooks/ and tests/tools read them).
REPORT_KEYS = [
    "strategy", "world_size", "model", "optimizer", "lr", "steps", "global_batch", "micro_batches", "clip_norm",
    "clip_norm_type", "seed", "device", "backend", "first_step", "resumed_from", "save_dir", "save_every", "losses", "reference",
    "reference_losses", "max_param_diff", "final_loss", "reference_final_loss", "adamw_param_bound",
    "collectives_per_step", "collectives_per_step_theory",
    "setup_collectives", "bytes_per_step", "bytes_per_step_theory", "sent_bytes_per_step", "step_time_ms",
    "buckets", "comm_busy_ms_per_step", "exposed_comm_ms_per_step", "exposed_share_median", "comm_yield",
    "progress_yields_per_step", "layers", "reshard_after_forward", "prefetch_depth", "prefetch_limit", "dim",
    "peak_param_bytes", "peak_param_bytes_theory", "peak_grad_bytes", "peak_grad_bytes_theory", "auto_caps",
    "auto_caps_buckets_theory", "pool_buffers", "mesh", "defer_all_reduce", "groups", "peak_rss_bytes",
    "run_peak_rss_bytes", "base_rss_bytes", "construction_rss_bytes", "base_data_bytes",
    "memory_limit_mib", "construction", "trace_dir", "config"]


def check(ok, message):
    print(("ok:   " if ok else "FAIL: ") + message, flush=True)
    if not ok:
        errors.append(message)


def run(*args):
    cmd = [SHARDLAB, *args]
    print("running:", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def report_ok(report, what):
    check(list(report) == REPORT_KEYS, f"{what}: the documented keys, in order (extra "
          f"{sorted(set(report) - set(REPORT_KEYS))}, missing {sorted(set(REPORT_KEYS) - set(report))})")
    check(isinstance(report["world_size"], int) and isinstance(report["losses"], list)
          and all(isinstance(x, float) for x in report["losses"]), f"{what}: typed values")
    # Counts are integers when whole, as the report wrote them before nlohmann ("26", not "26.0").
    check(all(isinstance(report[k], int) for k in ("setup_collectives", "bytes_per_step_theory")),
          f"{what}: whole counts written as integers: {report['setup_collectives']!r}, "
          f"{report['bytes_per_step_theory']!r}")


with tempfile.TemporaryDirectory() as tmp:
    # A path with a quote and a backslash: written as JSON strings must be.
    odd = os.path.join(tmp, 'odd "dir" \\ x')
    os.mkdir(odd)
    path = os.path.join(odd, "train.json")
    run("train", "--strategy", "bucketed_ddp", "--steps", "2", "--trace", odd, "--json", path)
    report = json.load(open(path))
    report_ok(report, "train --json")
    check(report["trace_dir"] == odd, f"the trace directory, quote and backslash included: {report['trace_dir']!r}")
    trace = json.load(open(os.path.join(odd, "rank0.trace.json")))
    check(trace.get("displayTimeUnit") == "ms" and any(e.get("cat") == "comm" for e in trace["traceEvents"]),
          "the trace is JSON with the collectives in it")

    prefix = os.path.join(tmp, "ddp")
    run("bench", "--section", "ddp", "--steps", "3", "--repeat", "1", "--out", prefix)  # tiny_gpt: the peer's model
    bench = json.load(open(prefix + ".json"))
    check(list(bench) == ["ddp", "fsdp", "reduce_scatter", "hsdp", "real"] and bench["fsdp"] is None
          and bench["hsdp"] is None and bench["real"] is None, f"the sections, null where not run: {list(bench)}")
    ddp = bench["ddp"]
    check(list(ddp) == ["pytorch_ddp", "repeat", "threads", "strategies"], f"the DDP section's keys: {list(ddp)}")
    peer = ddp["pytorch_ddp"]
    check(list(peer) == ["ok", "median_step_ms", "torch_version"], f"the peer's keys: {list(peer)}")
    try:
        import torch  # noqa: F401  (the peer ran only where python3 has torch)
        has_torch = True
    except ImportError:
        has_torch = False
    if has_torch:
        check(peer["ok"] is True and peer["median_step_ms"] > 0 and peer["torch_version"] != "",
              f"PyTorch DDP's figures read back from its JSON: {peer}")
    check(len(ddp["strategies"]) >= 8, f"a report per strategy row: {len(ddp['strategies'])}")
    for r in ddp["strategies"]:
        report_ok(r, f"bench ddp, {r.get('strategy')}")

    prefix = os.path.join(tmp, "rs")
    run("bench", "--section", "reduce_scatter", "--repeat", "1", "--out", prefix)
    rs = json.load(open(prefix + ".json"))["reduce_scatter"]
    check([p["world"] for p in rs] == [2, 3, 4], f"one probe per world size: {[p.get('world') for p in rs]}")
    row_keys = ["bytes", "ring_ms", "all_reduce_ms", "ring_sent", "all_reduce_sent", "ag_ring_ms", "ag_backend_ms",
                "ag_backend_copy"]
    check(all(list(row) == row_keys and row["ring_ms"] > 0 for p in rs for row in p["rows"])
          and all(len(p["rows"]) == 6 for p in rs),
          "every probe row has its keys and a time")

if errors:
    sys.exit("FAILED:\n  " + "\n  ".join(errors))
print("check_bench_json: all passed")
