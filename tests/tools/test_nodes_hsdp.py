#!/usr/bin/env python3
"""Two `shardlab-run` launchers on this machine as two nodes of 2 processes each (torchrun's --nnodes/--node-rank)
train HSDP on a 2x2 mesh through `shardlab worker`, as HSDP is deployed: each node's two ranks are a replica (its
shard group, a row of the mesh), and the two nodes replicate each other (the replicate groups, the columns, go
across the nodes). Checks, from the files the ranks write:
  - every rank's parameters equal one device's on the union batch (the `single` strategy's worker) within 1e-5, and
    the four ranks' are bit-identical (the replicas of a shard stay equal);
  - the global loss (the mean of the ranks' slice losses) equals one device's within 1e-4;
  - every rank communicated on both of its groups, the same number of collectives on each as every other rank, and
    its groups are the node's (shard: its node's two ranks) and the column's across the nodes (replicate).

Usage: test_nodes_hsdp.py SHARDLAB_RUN SHARDLAB. No check reads a clock: a hang is caught by the launchers'
--timeout and the test's ctest TIMEOUT."""
import json
import os
import socket
import subprocess
import sys
import tempfile

from checkpoint_reader import read_safetensors

launcher, shardlab = sys.argv[1], sys.argv[2]
train = ["--model", "tiny_gpt", "--layers", "2", "--steps", "3", "--global-batch", "16"]
failures = []


def read_result(path):
    """A rank's figures (rankR.json), flattened to what the checks below read."""
    result = json.load(open(path))
    out = {"losses": result["losses"]}
    for role, group in result["groups"].items():
        out[f"group_{role}"] = [group["collectives"], group["bytes"]]
        out[f"group_name_{role}"] = [group["name"]]
    return out


def read_params(path):
    """A rank's parameters (rankR.safetensors: float64 tensors named by registration index), flattened in that
    order, through docs/checkpoints.md's reader."""
    tensors, _ = read_safetensors(path)
    return [float(v) for name in sorted(tensors) for v in tensors[name].reshape(-1)]


with tempfile.TemporaryDirectory() as tmp:
    hsdp_dir, ref_dir = os.path.join(tmp, "hsdp"), os.path.join(tmp, "single")
    os.makedirs(hsdp_dir)
    os.makedirs(ref_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    for node in (0, 1):
        cmd = [launcher, "-n", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--timeout", "120", "--", shardlab, "worker", "--strategy", "hsdp",
               "--mesh", "2x2", "--world-size", "4", *train, "--result-dir", hsdp_dir]
        print("run ", " ".join(cmd[1:]), flush=True)
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for node, p in enumerate(nodes):
        out, _ = p.communicate()
        print(f"--- node {node}: exit {p.returncode}\n{out}")
        if p.returncode != 0:
            failures.append(f"node {node} exited with {p.returncode}")
    ref_cmd = [shardlab, "worker", "--strategy", "single", "--world-size", "1", *train, "--result-dir", ref_dir]
    print("run ", " ".join(ref_cmd[1:]), flush=True)
    if subprocess.run(ref_cmd, stdout=subprocess.DEVNULL, timeout=120).returncode != 0:
        failures.append("the single-device worker failed")
    if not failures:
        ref = read_params(os.path.join(ref_dir, "rank0.safetensors"))
        ref_losses = read_result(os.path.join(ref_dir, "rank0.json"))["losses"]
        texts = [read_result(os.path.join(hsdp_dir, f"rank{r}.json")) for r in range(4)]
        params = [read_params(os.path.join(hsdp_dir, f"rank{r}.safetensors")) for r in range(4)]
        for r in range(4):
            if len(params[r]) != len(ref):
                failures.append(f"rank {r} wrote {len(params[r])} parameters; one device has {len(ref)}")
                continue
            diff = max(abs(a - b) for a, b in zip(params[r], ref))
            print(f"rank {r}: max |param - one device| = {diff:.3g}; collectives per group "
                  f"shard {texts[r].get('group_shard')}, replicate {texts[r].get('group_replicate')}")
            if not diff <= 1e-5:
                failures.append(f"rank {r} is {diff} away from one device")
            if params[r] != params[0]:
                failures.append(f"rank {r}'s parameters are not bit-identical to rank 0's")
            node = r // 2  # launcher node K holds global ranks 2K, 2K + 1
            want = {"group_name_shard": [f"shard({2 * node},{2 * node + 1})"],
                    "group_name_replicate": [f"replicate({r % 2},{r % 2 + 2})"]}
            for key, name in want.items():
                if texts[r].get(key) != name:
                    failures.append(f"rank {r} (node {node}): expected its {key[11:]} group {name[0]}; got "
                                    f"{texts[r].get(key)}")
            for role in ("group_shard", "group_replicate"):
                got = texts[r].get(role, [0])[0]
                if got <= 0 or got != texts[0].get(role, [0])[0]:
                    failures.append(f"rank {r}: {got} collectives on its {role[6:]} group; rank 0 had "
                                    f"{texts[0].get(role, [0])[0]} (expected the same, more than 0)")
        losses = [sum(t["losses"][s] for t in texts) / 4 for s in range(len(ref_losses))]
        worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(f"global loss per step {losses}; one device {ref_losses}; worst difference {worst:.3g}")
        if not worst <= 1e-4:
            failures.append(f"the global loss differs from one device's by {worst}")
for f in failures:
    print("FAIL", f)
print("test_nodes_hsdp:", "FAIL" if failures else "ok")
sys.exit(1 if failures else 0)
