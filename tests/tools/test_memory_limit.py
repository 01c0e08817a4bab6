#!/usr/bin/env python3
"""A model that does not fit (Note [A rank's memory limit] in tools/shardlab/worker.cpp): each rank's data memory is
limited below what DDP needs (the whole parameters and gradients, plus the process's base); FSDP on 4 ranks trains
under it and matches one device (computed by the driver, outside the limit); bucketed DDP fails with an
out-of-memory error that names the limit, on the rank that asked, with nothing hanging.
Usage: test_memory_limit.py SHARDLAB"""
import json
import os
import subprocess
import sys
import tempfile

SHARDLAB = sys.argv[1]
WORLD, DIM, LAYERS, VOCAB, BLOCK = 4, 512, 16, 65, 32
errors = []


def check(ok, message):
    print(("ok:   " if ok else "FAIL: ") + message, flush=True)
    if not ok:
        errors.append(message)


def train(tmp, name, *args):
    path = os.path.join(tmp, name + ".json")
    cmd = [SHARDLAB, "train", "--world-size", str(WORLD), "--global-batch", "4", *args, "--json", path]
    print("running:", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = json.load(open(path)) if p.returncode == 0 else None
    return p, report


# The tiny GPT's parameters: token and position embeddings, per block two LayerNorms, qkv (no bias), proj, fc, out,
# then the final LayerNorm (common/course/src/models.cpp).
d = DIM
params = VOCAB * d + BLOCK * d + LAYERS * (2 * 2 * d + 3 * d * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d) + 2 * d
model_mib = params * 4 / 2**20
with tempfile.TemporaryDirectory() as tmp:
    # The process's base: data memory when the limit is set, with libtorch, Gloo's threads and OpenBLAS's buffers up
    # (the same world size: the threads count). A small model under a limit no run reaches.
    p, probe = train(tmp, "probe", "--strategy", "fsdp", "--model", "mlp", "--steps", "1", "--memory-limit-mib",
                     "100000")
    if probe is None:
        sys.exit(f"the probe run failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    base_mib = max(probe["base_data_bytes"]) / 2**20
    # Below DDP's need by its own theory: the base, the whole parameters and their gradients.
    limit = int(base_mib + 2 * model_mib) - 8
    print(f"tiny GPT {DIM}x{LAYERS}: {params} parameters, {model_mib:.0f} MiB; base {base_mib:.0f} MiB; "
          f"limit {limit} MiB < base + parameters + gradients = {base_mib + 2 * model_mib:.0f} MiB", flush=True)
    common = ["--model", "tiny_gpt", "--dim", str(DIM), "--layers", str(LAYERS), "--memory-limit-mib", str(limit)]

    p, fsdp = train(tmp, "fsdp", "--strategy", "fsdp", "--steps", "2", *common)  # 2: a step after the first
    check(fsdp is not None, f"FSDP on {WORLD} ranks trains under {limit} MiB per rank (exit {p.returncode})")
    if fsdp is None:
        print(p.stdout[-3000:], p.stderr[-3000:])
    else:
        print("FSDP: resident MiB per rank, run peak", [b >> 20 for b in fsdp["run_peak_rss_bytes"]],
              "base data", [b >> 20 for b in fsdp["base_data_bytes"]], "parameter and gradient theory",
              (fsdp["peak_param_bytes_theory"] + fsdp["peak_grad_bytes_theory"]) >> 20, "MiB")
        check(fsdp["memory_limit_mib"] == limit, f"the report records the limit ({fsdp['memory_limit_mib']})")
        check(fsdp["construction"] == "sharded", "built sharded")
        check(fsdp["max_param_diff"] <= 1e-5,
              f"matches one device computed outside the limit: max parameter difference {fsdp['max_param_diff']}")

    p, ddp = train(tmp, "ddp", "--strategy", "bucketed_ddp", "--steps", "1", *common)
    said = p.stdout + p.stderr
    wanted = (f"out of memory: each rank's data memory is limited to {limit} MiB (--memory-limit-mib, RLIMIT_DATA) "
              "and an allocation failed")
    check(p.returncode != 0, f"bucketed DDP fails under the same limit (exit {p.returncode})")
    check(wanted in said, "DDP's error names the limit and what failed")
    check(p.returncode != 0 and p.returncode < 128, f"an error exit, not a signal (exit {p.returncode})")
    print("\n".join(line for line in said.splitlines() if "out of memory" in line or "failed" in line)[:2000])
if errors:
    sys.exit("; ".join(errors))
print("ok")
