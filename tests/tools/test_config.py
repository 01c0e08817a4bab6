#!/usr/bin/env python3
"""`shardlab train --write-config` and `--config`: a run written to TOML is the same run again, bit for bit.

For two runs with many options away from their defaults (FSDP with prefetch, AdamW, clipping and micro-batches; DDP
with a repeated --bucket-cap-kb, an array in TOML):
  - the file is TOML (Python's tomllib reads it), holds every option given, and names only options of train --help;
  - `train --config FILE` trains with the same losses and parameter difference bit for bit, and its report's
    `config` is the file's;
  - a flag given beside --config wins (another seed: the losses differ, so the comparison above can fail), also
    where the file's values would clash with it (another strategy, mesh or world size);
  - a key no option has (or another command's), a bad value, a missing file, --config with another command and a
    value a config file cannot hold are usage errors (exit 2) that name what is wrong;
  - `shardlab worker --config FILE` (one rank; on several machines every rank reads the same file) trains the file's
    run: one device's losses bit for bit as `train` had them; a run option typed beside it is refused.

Usage: test_config.py SHARDLAB SHARDLAB_CLI_BATCH. The runs are processes; the usage errors and --help go to one
shardlab_cli_batch process at the end (shardlab_batch.py: libtorch loads once for them all).
"""
import json
import os
import subprocess
import sys
import tempfile
import tomllib

import shardlab_batch

shardlab, batch = sys.argv[1], sys.argv[2]
failures = 0
refusals = []  # (arguments, needle): usage_error's, checked at the end in one batch


def check(ok, what, detail=""):
    global failures
    print("ok  " if ok else "FAIL", what, detail if not ok else "", flush=True)
    failures += 0 if ok else 1


def run(args, code=0):
    print("run ", " ".join(args), flush=True)
    p = subprocess.run([shardlab, *args], capture_output=True, text=True)
    if p.returncode != code:
        print(p.stdout + p.stderr)
    check(p.returncode == code, f"exit {p.returncode}, expected {code}")
    return p.stdout + p.stderr


def help_options():
    [(code, out)] = shardlab_batch.run_batch(batch, [["train", "--help"]])
    check(code == 0, f"train --help: exit {code}", out)
    return {w.split(":")[0].split("=")[0][2:] for line in out.splitlines() for w in line.split()[:1]
            if w.startswith("--")}


def report(path):
    with open(path) as f:
        return json.load(f)


def same_run_again(tmp, name, args, expect):
    """Trains with `args` and --write-config, then from the file alone; the two must be the same run."""
    toml_path, a_json, b_json, c_json = (os.path.join(tmp, name + x) for x in (".toml", "-a.json", "-b.json", "-c.json"))
    run(["train", *args, "--write-config", toml_path, "--json", a_json])
    with open(toml_path, "rb") as f:
        written = tomllib.load(f)
    train = written.get("train", {})
    check(list(written) == ["train"], f"{name}: one train table", f"got tables {list(written)}")
    for key, value in expect.items():
        check(train.get(key) == value, f"{name}: {key} = {value!r} written", f"got {train.get(key)!r}")
    unknown = set(train) - help_options()
    check(not unknown, f"{name}: every key is an option of train --help", f"unknown: {sorted(unknown)}")
    check("json" not in train and "write-config" not in train, f"{name}: the outputs of this invocation are not in it")

    run(["train", "--config", toml_path, "--json", b_json])
    a, b = report(a_json), report(b_json)
    for key in ("losses", "reference_losses", "max_param_diff", "strategy", "world_size"):
        check(a[key] == b[key], f"{name}: {key} the same from the file", f"{a[key]} vs {b[key]}")
    with open(toml_path) as f:
        check(f.read().endswith(a["config"]) and a["config"] == b["config"], f"{name}: the report's config is the file's")

    # A flag beside --config wins, and the run differs: the comparison above can fail.
    run(["train", "--config", toml_path, "--seed", "8", "--json", c_json])
    c = report(c_json)
    check(tomllib.loads(c["config"])["train"]["seed"] == 8, f"{name}: --seed 8 beside --config is in force",
          c["config"])
    check(c["losses"] != a["losses"], f"{name}: another seed, other losses", f"{c['losses']} vs {a['losses']}")


def runs_with(tmp, args, expect):
    """`train args` trains, and its report says `expect`."""
    out = os.path.join(tmp, "runs-with.json")
    run(["train", *args, "--json", out])
    if os.path.exists(out):
        r = report(out)
        os.remove(out)
        for key, value in expect.items():
            check(r[key] == value, f"{' '.join(args[2:])}: {key} {value!r}", f"got {r[key]!r}")


def usage_error(args, needle, tmp, toml_text=None):
    """`args` is a usage error (exit 2) whose message holds `needle`; checked by check_usage_errors()."""
    if toml_text is not None:
        path = os.path.join(tmp, f"bad{len(refusals)}.toml")
        with open(path, "w") as f:
            f.write(toml_text)
        args = [a.replace("BAD", path) for a in args]
    refusals.append((args, needle))


def check_usage_errors():
    for (args, needle), (code, out) in zip(refusals, shardlab_batch.run_batch(batch, [a for a, _ in refusals])):
        print("run ", " ".join(args), "(batch)", flush=True)
        check(code == 2, f"exit {code}, expected 2", out)
        check(needle in out, f"the message names it: {needle!r}", out)


with tempfile.TemporaryDirectory() as tmp:
    same_run_again(tmp, "fsdp_prefetch",
                   ["--strategy", "fsdp_prefetch", "--world-size", "2", "--model", "tiny_gpt", "--layers", "2",
                    "--dim", "16", "--steps", "3", "--global-batch", "8", "--micro-batches", "2", "--optimizer",
                    "adamw", "--lr", "0.01", "--seed", "7", "--prefetch-depth", "2", "--clip-norm", "0.5",
                    "--clip-norm-type", "inf"],
                   {"strategy": "fsdp_prefetch", "model": "tiny_gpt", "layers": 2, "dim": 16, "steps": 3,
                    "global-batch": 8, "micro-batches": 2, "optimizer": "adamw", "lr": 0.01, "seed": 7,
                    "prefetch-depth": 2, "clip-norm": 0.5,
                    "clip-norm-type": float("inf")})  # CLI11 writes inf bare: a TOML float, read back as "inf"
    same_run_again(tmp, "bucketed_auto",
                   ["--strategy", "bucketed_ddp", "--steps", "3", "--bucket-cap-kb", "32", "--bucket-cap-kb", "auto",
                    "--first-bucket-kb", "16", "--comm-yield", "off", "--threads", "1"],
                   {"strategy": "bucketed_ddp", "bucket-cap-kb": [32, "auto"], "first-bucket-kb": 16,
                    "comm-yield": "off", "threads": 1})
    # A typed flag wins over the file, and the checks blame only what was typed: a file's world size, mesh, prefetch
    # or bucket caps give way to another --strategy, --mesh or --world-size.
    runs_with(tmp, ["--config", os.path.join(tmp, "bucketed_auto.toml"), "--strategy", "single", "--steps", "1"],
              {"strategy": "single", "world_size": 1})
    runs_with(tmp, ["--config", os.path.join(tmp, "fsdp_prefetch.toml"), "--strategy", "fsdp", "--steps", "1"],
              {"strategy": "fsdp", "world_size": 2})
    run(["train", "--strategy", "hsdp", "--world-size", "4", "--steps", "1", "--write-config",
         os.path.join(tmp, "hsdp.toml")])
    runs_with(tmp, ["--config", os.path.join(tmp, "hsdp.toml"), "--mesh", "1x2"], {"strategy": "hsdp", "world_size": 2})
    runs_with(tmp, ["--config", os.path.join(tmp, "hsdp.toml"), "--strategy", "fsdp", "--world-size", "2"],
              {"strategy": "fsdp", "world_size": 2})
    # A value that cannot work is refused wherever it came from: the file's --clip-norm with a strategy that
    # cannot clip.
    usage_error(["train", "--config", os.path.join(tmp, "fsdp_prefetch.toml"), "--strategy", "overlap_optimizer"],
                "--clip-norm needs the whole gradient before any parameter steps", tmp)
    usage_error(["train", "--steps", "1", "--trace", os.path.join(tmp, "a#b"), "--write-config",
                 os.path.join(tmp, "hash.toml")], "--write-config cannot write --trace", tmp)
    usage_error(["train", "--steps", "1", "--save", os.path.join(tmp, "it's \"x\""), "--write-config",
                 os.path.join(tmp, "quotes.toml")], "--write-config cannot write --save", tmp)
    usage_error(["--config", os.path.join(tmp, "hsdp.toml"), "compare"], "--config: reads the options of shardlab "
                "train; got it with shardlab compare", tmp)
    usage_error(["train", "--config", "BAD"], "compare.steps", tmp, "[compare]\nsteps = 2\n")
    usage_error(["train", "--config", "BAD"], "the file sets 'train.bogus', which no option takes", tmp,
                "[train]\nsteps = 2\nbogus = 1\n")
    usage_error(["train", "--config", "BAD"], "the file sets 'steps', which no option takes (the options of shardlab "
                "train --help, in its table: train.steps = 3", tmp, "steps = 2\n")
    usage_error(["train", "--config", "BAD"], "--steps: expects an integer in [1, 100000]; got 'ten'", tmp,
                "[train]\nsteps = \"ten\"\n")
    usage_error(["train", "--config", os.path.join(tmp, "missing.toml")], "--config expects a readable TOML file", tmp)

    # A worker takes the same file (one rank each; several machines share it): one device's run, as train ran it.
    single, single_json, ranks = (os.path.join(tmp, x) for x in ("single.toml", "single.json", "ranks"))
    run(["train", "--strategy", "single", "--steps", "2", "--seed", "5", "--write-config", single, "--json",
         single_json])
    os.makedirs(ranks)
    run(["worker", "--config", single, "--result-dir", ranks])
    worker_losses = report(os.path.join(ranks, "rank0.json"))["losses"]
    train_losses = report(single_json)["losses"]
    check(worker_losses == train_losses, "worker --config trains the file's run: the same losses bit for bit",
          f"worker {worker_losses}, train {train_losses}")
    usage_error(["worker", "--config", single, "--steps", "3", "--result-dir", ranks],
                "worker --config takes every run option from the file; got --steps too", tmp)
    usage_error(["worker", "--config", "BAD", "--result-dir", ranks], "the file sets 'train.bogus', which no option takes",
                tmp, "[train]\nsteps = 2\nbogus = 1\n")
    check_usage_errors()

sys.exit(1 if failures else 0)
