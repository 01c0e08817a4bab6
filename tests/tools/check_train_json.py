#!/usr/bin/env python3
"""Runs `shardlab train` as real processes and checks its JSON report: the keys, equivalence with the
single-device reference, and measured traffic equal to theory.
Usage: check_train_json.py SHARDLAB [--max-diff X] ARGS...   (X: allowed max parameter difference, default 1e-5)"""
import json
import os
import subprocess
import sys
import tempfile

args = sys.argv[2:]
max_diff = 1e-5
if args[:1] == ["--max-diff"]:
    max_diff, args = float(args[1]), args[2:]
if any(a == "--reference" and v == "none" for a, v in zip(args, args[1:])):
    sys.exit("check_train_json.py compares the ranks with one device; --reference none is check_no_reference.py's")
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "report.json")
    cmd = [sys.argv[1], "train", *args, "--json", path]
    print("running:", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, timeout=300)
    if p.returncode != 0:
        sys.exit(f"shardlab train exited with {p.returncode}")
    report = json.load(open(path))

required = ["strategy", "world_size", "optimizer", "losses", "reference_losses", "max_param_diff", "final_loss",
            "reference_final_loss", "adamw_param_bound", "collectives_per_step",
            "bytes_per_step", "bytes_per_step_theory", "step_time_ms"]
missing = [k for k in required if k not in report]
print("max_param_diff", report.get("max_param_diff"), "collectives/step", report.get("collectives_per_step"),
      "theory", report.get("collectives_per_step_theory"), "bytes/step", report.get("bytes_per_step"),
      "theory", report.get("bytes_per_step_theory"))
errors = []
if missing:
    errors.append(f"missing keys {missing}")
else:
    if len(report["losses"]) != len(report["reference_losses"]):
        errors.append("losses and reference_losses differ in length")
    # Note [Comparing with one device] (common/course/src/reference.cpp): SGD's parameters tight; AdamW's within AdamW's
    # own bound, its losses tight (below).
    allowed = report["adamw_param_bound"] if report["optimizer"] == "adamw" else max_diff
    if not report["max_param_diff"] <= allowed:
        errors.append(f"max_param_diff {report['max_param_diff']} > {allowed}")
    # The theory is the tool's own (tools/shardlab/traffic.cpp), computed apart from the strategy's code: for the
    # bucketed strategies a count of the cap rule, not stage 02's assign_buckets, so a wrong rule shows here.
    auto = any(a == "--bucket-cap-kb" and v == "auto" for a, v in zip(args, args[1:]))
    if auto:
        # --bucket-cap-kb auto: the caps change after step 2, so the count per step is no longer one theory's.
        # Instead: the choice is reported, and by the model it exposes no more than the caps it replaced.
        caps = report.get("auto_caps", [])
        print("auto caps", caps)
        if len(caps) != 6:
            errors.append(f"expected auto_caps [first, later, alpha, beta, exposed before, exposed after]; got {caps}")
        elif not (caps[0] > 0 and caps[1] > 0 and caps[5] <= caps[4] + 1e-6):
            errors.append(f"auto caps must be positive and model no more exposure than before; got {caps}")
        # ... and the layout took them: the buckets at the end are what the cap rule makes of the chosen caps.
        print("buckets", report.get("buckets"), "theory for the chosen caps", report.get("auto_caps_buckets_theory"))
        if report.get("buckets") != report.get("auto_caps_buckets_theory"):
            errors.append(f"after auto caps the layout has {report.get('buckets')} buckets; the chosen caps make "
                          f"{report.get('auto_caps_buckets_theory')} by the cap rule (set_caps not taken?)")
    elif report["collectives_per_step"] != report["collectives_per_step_theory"]:
        errors.append(f"collectives per step {report['collectives_per_step']} differ from theory "
                      f"{report['collectives_per_step_theory']}")
    if report["bytes_per_step"] != report["bytes_per_step_theory"]:
        errors.append(f"bytes per step {report['bytes_per_step']} differ from theory {report['bytes_per_step_theory']}")
    # Per group (its mesh's: the DDP strategies' replicate group, FSDP's shard group, hsdp's row's shard group and its
    # column's replicate group; naive_ddp: the world), measured on rank 0 beside the theory of that group.
    groups = report.get("groups", {})
    print("groups", groups)
    if not groups:
        errors.append("missing the per-group figures ('groups')")
    for role, g in groups.items():
        for what in ("bytes_per_step",) if auto else ("collectives_per_step", "bytes_per_step"):
            if g.get(what) != g.get(what + "_theory"):
                errors.append(f"{role} group: {what} {g.get(what)} differ from theory {g.get(what + '_theory')}")
    mesh = next((v for a, v in zip(args, args[1:]) if a == "--mesh"), None)
    if mesh is not None:
        replicas = int(mesh.split("x")[0])
        if report.get("mesh") != mesh:
            errors.append(f"expected mesh {mesh} in the report; got {report.get('mesh')!r}")
        want = {"shard", "replicate"} if replicas > 1 else {"shard"}
        if set(groups) != want:
            errors.append(f"a {mesh} mesh communicates on the groups {sorted(want)}; got {sorted(groups)}")
    if report["strategy"].startswith("fsdp") or report["strategy"] == "hsdp":
        # Memory: measured by FSDP's meter. Parameters: the theory is the peak the design holds, buffer for buffer
        # (a measured peak below it means the meter misses a buffer; above 1.05x, the design holds one too many).
        # Gradients: the theory is an upper bound (Note [The gradient peak, walked]): measured above it means a
        # buffer the theory does not count.
        for key in ("peak_param_bytes", "peak_param_bytes_theory", "peak_grad_bytes", "peak_grad_bytes_theory"):
            if key not in report:
                errors.append(f"missing key {key}")
        if not errors:
            print("peak param bytes", report["peak_param_bytes"], "theory", report["peak_param_bytes_theory"],
                  "peak grad bytes", report["peak_grad_bytes"], "theory", report["peak_grad_bytes_theory"])
            if not report["peak_param_bytes_theory"] <= report["peak_param_bytes"]:
                errors.append("measured parameter peak below theory: the accounting misses a buffer")
            if not report["peak_param_bytes"] <= 1.05 * report["peak_param_bytes_theory"]:
                errors.append("measured parameter peak above 1.05x theory: a buffer the theory does not count")
            if not report["peak_grad_bytes"] <= report["peak_grad_bytes_theory"]:
                errors.append("measured gradient peak above theory: a buffer the theory does not count")
    # Resident memory (Note [Peak RSS over the steady state]): every rank's base, steady peak and the run's peak,
    # which covers the steady window, so it is at least the steady peak and above the base.
    rss, run_rss, base, built = (report.get(k, []) for k in ("peak_rss_bytes", "run_peak_rss_bytes",
                                                             "base_rss_bytes", "construction_rss_bytes"))
    print("resident MiB per rank: base", [b >> 20 for b in base], "built", [b >> 20 for b in built], "run peak",
          [b >> 20 for b in run_rss], "steady peak", [b >> 20 for b in rss], "construction", report.get("construction"))
    if not all(len(v) == report["world_size"] and all(b > 0 for b in v) for v in (rss, run_rss, base, built)):
        errors.append(f"expected every rank's base, construction, run and steady peak RSS; got {base}, {built}, "
                      f"{run_rss}, {rss}")
    elif not all(b < c <= r and s <= r for b, c, s, r in zip(base, built, rss, run_rss)):
        errors.append(f"expected base < construction peak <= run peak and steady peak <= run peak on every rank; got "
                      f"{base}, {built}, {rss}, {run_rss}")
    # How the model was built: sharded for the strategies that shard (Note [Sharded construction]); the others say
    # why they build it whole.
    sharded = report["strategy"].startswith("fsdp") or report["strategy"] == "hsdp"
    construction = report.get("construction", "")
    if sharded != (construction == "sharded") or not (sharded or construction.startswith("whole: ")):
        errors.append(f"{report['strategy']} reports construction {construction!r}; expected 'sharded' for the "
                      f"strategies that shard, 'whole: <why>' for the others")
    pairs = list(zip(report["losses"] + [report["final_loss"]],
                     report["reference_losses"] + [report["reference_final_loss"]]))
    worst = max(abs(a - b) for a, b in pairs)
    print("max |loss - reference loss|, the final parameters' loss on the next batch included", worst)
    if report["optimizer"] == "adamw":  # the losses carry AdamW's check: 1e-4 relative
        rel = max(abs(a - b) / abs(b) for a, b in pairs)
        print("AdamW: max relative loss difference", rel)
        if rel > 1e-4:
            errors.append(f"AdamW: a loss differs from the reference's by {rel:.3g} relative (more than 1e-4)")
    elif worst > max(1e-4, 10 * max_diff):
        errors.append(f"loss differs from the reference by {worst}")
if errors:
    sys.exit("; ".join(errors))
print("ok")
