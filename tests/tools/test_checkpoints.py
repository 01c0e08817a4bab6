#!/usr/bin/env python3
"""Checkpoints through the tool, as real processes (issue 20):
  1. `shardlab train --save` at world size 2 (FSDP); `--resume` at world size 2 (FSDP) is the run that was not
     stopped, bit for bit; at world size 3 (bucketed DDP) it continues as the single-device run (AdamW: by its
     losses, Note [Comparing with one device]), and a copy that lost its first moments fails that; `shardlab
     export` writes one safetensors file; the reader of docs/checkpoints.md (numpy only, run from the document
     itself) reads both, and Hugging Face's reader where it is installed.
  2. PyTorch, both ways (where python3 has torch): the exported weights load into the bench's PyTorch tiny GPT
     (tools/bench/torch_ddp.py) and give the loss shardlab reported on the same batch; PyTorch's weights, saved as
     safetensors, start a shardlab run whose first loss is PyTorch's.
  3. Kills: a rank killed in the middle of training stops the job, naming the rank, and the last checkpoint is
     whole and resumable; the whole job killed at random moments while it saves every step never leaves a
     checkpoint that fails its checks.
Usage: test_checkpoints.py SHARDLAB SOURCE_DIR [PARTS]"""
import importlib.util
import json
import os
import queue
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np

SHARDLAB, SOURCE = sys.argv[1], sys.argv[2]
# Which parts: "resume" (1 and 2, which compare with one device and PyTorch) and "kills" (3), comma-separated; both
# by default. ctest runs them as tool_checkpoints and tool_checkpoint_kills, so that CI can run the first again under
# a second BLAS kernel without the second.
PARTS = set((sys.argv[3] if len(sys.argv) > 3 else "resume,kills").split(","))
errors = []


def check(ok, message):
    print(("ok:   " if ok else "FAIL: ") + message, flush=True)
    if not ok:
        errors.append(message)


from checkpoint_reader import read_safetensors, read_sharded  # the document's own reader: the lines a user copies


def run(*args, timeout=300):
    cmd = [SHARDLAB, *args]
    print("running:", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def train(tmp, name, *args):
    path = os.path.join(tmp, name + ".json")
    run("train", *args, "--json", path)
    return json.load(open(path))


def write_safetensors(path, tensors, metadata=None):  # what torch's and numpy's users write: the plain format
    header, offset, blobs = {}, 0, []
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def zero_first_moments(src, dst):
    """Copies checkpoint `src` to `dst` with every AdamW first moment (`optim.<name>.exp_avg`) zero and the index's
    CRC-32s of those pieces recomputed. Returns how many tensors it zeroed."""
    shutil.copytree(src, dst)
    index = json.load(open(os.path.join(dst, "index.json")))
    crcs, zeroed = {}, 0
    for name in index["files"]:
        path = os.path.join(dst, name)
        raw = bytearray(open(path, "rb").read())
        n = struct.unpack("<Q", raw[:8])[0]
        for tensor, entry in json.loads(raw[8:8 + n]).items():
            if tensor.endswith(".exp_avg"):
                begin, end = entry["data_offsets"]
                raw[8 + n + begin:8 + n + end] = bytes(end - begin)
                crcs[(name, tensor)] = zlib.crc32(bytes(end - begin))
                zeroed += 1
        open(path, "wb").write(raw)
    for tensor, saved in index["tensors"].items():
        for piece in saved["pieces"]:
            piece["crc32"] = crcs.get((piece["file"], tensor), piece["crc32"])
    json.dump(index, open(os.path.join(dst, "index.json"), "w"))
    return zeroed


with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "ckpt")
    common = ["--model", "tiny_gpt", "--global-batch", "12", "--optimizer", "adamw", "--lr", "0.01"]
    if "resume" not in PARTS:
        print("skip: the resume and PyTorch parts (1, 2), as asked")
    else:
        # ---- 1. save at 2 (FSDP), resume at 2 and at 3 (bucketed DDP), export, read ------------------------------------
        first = train(tmp, "first", "--strategy", "fsdp", "--world-size", "2", "--steps", "2", *common, "--save", ckpt)
        check(first["save_dir"] == ckpt and first["first_step"] == 0, f"the report names the checkpoint: {first['save_dir']}")
        # What resume promises: at the same strategy and world size, the run that was stopped and resumed is the run
        # that was not, bit for bit (parameters and optimizer state, whatever the BLAS kernel).
        straight = train(tmp, "straight", "--strategy", "fsdp", "--world-size", "2", "--steps", "3", *common,
                         "--save", os.path.join(tmp, "straight"))
        again = train(tmp, "again", "--strategy", "fsdp", "--world-size", "2", "--steps", "3", *common,
                      "--resume", ckpt, "--save", os.path.join(tmp, "again"))
        a, b = read_sharded(os.path.join(tmp, "straight"))[0], read_sharded(os.path.join(tmp, "again"))[0]
        differ = sorted(k for k in a if k not in b or not np.array_equal(a[k], b[k]))
        check(set(a) == set(b) and not differ and again["losses"] == straight["losses"][2:],
              f"FSDP x2 stopped at step 2 and resumed equals FSDP x2 for 3 steps bit for bit ({len(a)} tensors, the "
              f"optimizer's included): differing {differ[:5]}, losses {again['losses']} vs {straight['losses'][2:]}")
        # Across strategies and world sizes the sums run in another order. Note [Comparing with one device]
        # (common/course/src/reference.cpp): with AdamW the losses are tight (the step's, and the final parameters' on the next
        # batch, which sees the resumed optimizer state), the parameters within AdamW's own bound.
        resumed = train(tmp, "resumed", "--strategy", "bucketed_ddp", "--world-size", "3", "--steps", "3", *common,
                        "--resume", ckpt)
        check(resumed["first_step"] == 2 and len(resumed["losses"]) == 1 and len(resumed["reference_losses"]) == 1,
              f"resumed at step 2, one step run: first_step {resumed['first_step']}, losses {resumed['losses']}")
        for what, mine, ref in (("step 2's loss", resumed["losses"][0], resumed["reference_losses"][0]),
                                ("the final parameters' loss on step 3's batch", resumed["final_loss"],
                                 resumed["reference_final_loss"])):
            check(abs(mine - ref) <= 1e-4 * abs(ref),
                  f"FSDP x2 for 2 steps, then DDP x3 for 1, against one device for 3: {what} {mine:.9f}, one device's "
                  f"{ref:.9f} (relative {abs(mine - ref) / abs(ref):.2g}, within 1e-4)")
        check(0 < resumed["adamw_param_bound"] and resumed["max_param_diff"] <= resumed["adamw_param_bound"],
              f"and the parameters within AdamW's bound: max |diff| {resumed['max_param_diff']:.3g} <= "
              f"{resumed['adamw_param_bound']:.3g}")
        # The same check can fail: a copy of the checkpoint whose AdamW first moments are zero (their CRC-32s made
        # right, so the load takes it), resumed the same way, is a resume that lost them.
        lost = os.path.join(tmp, "lost-moments")
        zeroed = zero_first_moments(ckpt, lost)
        broken = train(tmp, "broken", "--strategy", "bucketed_ddp", "--world-size", "3", "--steps", "3", *common,
                       "--resume", lost)
        rel = abs(broken["final_loss"] - broken["reference_final_loss"]) / abs(broken["reference_final_loss"])
        check(zeroed > 0 and rel > 1e-4,
              f"a resume whose {zeroed} first-moment tensors were zeroed is caught by the final loss: {rel:.2g} relative")
        late = subprocess.run([SHARDLAB, "train", "--strategy", "fsdp", "--world-size", "2", "--steps", "2", *common,
                               "--resume", ckpt], capture_output=True, text=True, timeout=120)
        check(late.returncode == 2 and "holds step 2; --steps is the step to train up to and must be greater" in late.stderr,
              f"--resume at step 2 with --steps 2 is refused before any rank starts: {late.stderr.strip()!r}")
        # Auto caps: chosen after step 2 from measured times, then kept by the checkpoint. A run resumed after that
        # trains with the saved caps and does not choose again (its buckets, and so its sums, stay the saved run's).
        auto = ["--strategy", "bucketed_ddp", "--world-size", "3", "--model", "mlp", "--global-batch", "12",
                "--first-bucket-kb", "4", "--bucket-cap-kb", "8", "--bucket-cap-kb", "auto"]
        tuned = train(tmp, "tuned", *auto, "--steps", "3", "--save", os.path.join(tmp, "auto1"))
        saved_caps = json.load(open(os.path.join(tmp, "auto1", "index.json")))["metadata"].get("bucketed_ddp.caps")
        chosen = tuned.get("auto_caps") or []
        check(len(chosen) == 6 and saved_caps == f"{int(chosen[0])} {int(chosen[1])}",
              f"the checkpoint keeps the caps chosen after step 2: saved {saved_caps!r}, chosen {chosen[:2]}")
        # Other caps on the command line (64 KiB, which auto never starts from here): the saved ones still win.
        other = [a if a not in ("4", "8") else "64" for a in auto]
        again = train(tmp, "again", *other, "--steps", "4", "--resume", os.path.join(tmp, "auto1"),
                      "--save", os.path.join(tmp, "auto2"))
        kept = json.load(open(os.path.join(tmp, "auto2", "index.json")))["metadata"].get("bucketed_ddp.caps")
        check(not again.get("auto_caps") and kept == saved_caps and saved_caps != "65536 65536",
              f"resumed at step 3 with other caps given, the caps are the saved ones and not chosen again: {kept!r}, "
              f"report {again.get('auto_caps')}")
        model_file = os.path.join(tmp, "model.safetensors")
        run("export", ckpt, model_file)
        weights, meta = read_safetensors(model_file)
        check(meta.get("step") == "2" and not any(k.startswith("optim.") for k in weights),
              f"the export holds the model only, with the step: {sorted(meta)}")
        whole, _ = read_sharded(ckpt)
        same = all(np.array_equal(weights[k], whole[k]) for k in weights)
        check(same and set(weights) <= set(whole), "the document's sharded reader gives the export's tensors bit for bit")
        try:
            from safetensors.numpy import load_file  # Hugging Face's reader (Debian trixie: python3-safetensors)
        except ImportError:
            print("skip: Hugging Face's safetensors is not installed here (trixie's python3-safetensors has it)")
        else:
            hf = load_file(model_file)
            check(set(hf) == set(weights) and all(np.array_equal(hf[k], weights[k]) for k in hf),
                  "Hugging Face's load_file reads the export as the document's reader does")
            shard = load_file(os.path.join(ckpt, "rank-00001-of-00002.safetensors"))
            check(len(shard) > 0, f"and each rank's file: {len(shard)} tensors in rank 1's")

        # ---- 2. PyTorch, both ways -----------------------------------------------------------------------------------
        try:
            import torch
        except ImportError:
            torch = None
            print("skip: python3 has no torch here (Debian 12's python3-torch has it)")
        if torch is not None:
            spec = importlib.util.spec_from_file_location("torch_ddp", os.path.join(SOURCE, "tools/bench/torch_ddp.py"))
            torch_ddp = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(torch_ddp)
            vocab = torch_ddp.corpus_vocab_size()

            def gpt(seed):
                return torch_ddp.TinyGpt(vocab, 32, 32, 2, 4, seed)

            def global_batch(step, size=12, seed=1):  # shardlab's TextDataset::global_batch, step for step
                mask = (1 << 64) - 1
                z = (seed * 0x9E3779B97F4A7C15 + 3 * 0xBF58476D1CE4E5B9 + step + 1) & mask
                z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
                z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
                z ^= z >> 31
                text = open(os.path.join(SOURCE, "common/course/data/tiny_corpus.txt"), "rb").read()
                vocab_chars = sorted(set(text))
                tokens = torch.tensor([vocab_chars.index(c) for c in text], dtype=torch.long)
                starts = torch.randint(len(tokens) - 32 - 1, (size,), generator=torch.Generator().manual_seed(z))
                index = starts.unsqueeze(1) + torch.arange(32).unsqueeze(0)
                return tokens[index], tokens[index + 1]

            def loss_of(m, step):
                with torch.no_grad():
                    return m(*global_batch(step)).item()

            # The tiny GPT ties its output layer to the token embedding under two names, wte.weight and
            # lm_head.weight, as GPT-2 does; shardlab's file holds the tie once, under its first name. PyTorch's
            # load_state_dict(strict=True) would call lm_head.weight missing: strict up to the tie.
            model = gpt(5)
            missing = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
            check(missing.missing_keys == ["lm_head.weight"] and not missing.unexpected_keys and
                  model.lm_head.weight is model.wte.weight,
                  f"the export loads into PyTorch's tiny GPT, the tie once: missing {missing.missing_keys}, "
                  f"unexpected {missing.unexpected_keys}")
            loss = loss_of(model, 2)
            check(abs(loss - resumed["losses"][0]) <= 1e-5 * abs(loss),
                  f"PyTorch's loss on step 2's batch {loss:.7f} = shardlab's {resumed['losses'][0]:.7f}")
            # PyTorch -> shardlab: its weights as safetensors start a run; the first loss is PyTorch's. A plain
            # state_dict holds the tie under both names (equal): shardlab takes it under both.
            theirs = gpt(7)
            torch_file = os.path.join(tmp, "torch.safetensors")
            state = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
            check("lm_head.weight" in state and "wte.weight" in state, "a state_dict names the tie twice")
            write_safetensors(torch_file, state)
            started = train(tmp, "from_torch", "--strategy", "single", "--world-size", "1", "--steps", "1", *common,
                            "--resume", torch_file)
            expected = loss_of(theirs, 0)
            check(abs(started["losses"][0] - expected) <= 1e-5 * abs(expected),
                  f"shardlab's first loss from PyTorch's weights {started['losses'][0]:.7f} = PyTorch's {expected:.7f}")

            # Hugging Face's safetensors.torch with PyTorch, both ways (CI's trixie line: torch 2.6).
            try:
                from safetensors import safe_open
                from safetensors.torch import load_model, save_model
            except ImportError:
                print("skip: Hugging Face's safetensors.torch is not installed here (CI's trixie line has it, with "
                      "torch 2.6)")
            else:
                print(f"PyTorch {torch.__version__} with Hugging Face's safetensors.torch")
                from safetensors.torch import load_file as torch_load_file, save_file as torch_save_file
                with safe_open(model_file, framework="pt") as f:
                    check(f.metadata().get("format") == "pt",
                          f"the export's metadata says format pt: {f.metadata().get('format')!r}")

                def layout(path):  # the tensors in the header's order, and the data's bytes
                    with open(path, "rb") as f:
                        n = int.from_bytes(f.read(8), "little")
                        pairs = json.loads(f.read(n), object_pairs_hook=list)
                        return [k for k, _ in pairs if k != "__metadata__"], f.read()

                again = os.path.join(tmp, "save_file.safetensors")
                torch_save_file(torch_load_file(model_file), again, metadata={"format": "pt"})
                ours, theirs_layout = layout(model_file), layout(again)
                check(ours == theirs_layout, "the export lays its tensors out as safetensors' save_file does (order and "
                      f"bytes): {ours[0][:4]}... against {theirs_layout[0][:4]}...")
                model = gpt(9)
                missing, unexpected = load_model(model, model_file, strict=True)
                check(not missing and not unexpected and model.lm_head.weight is model.wte.weight,
                      f"load_model(strict=True) takes the export, the tie kept: {missing}, {unexpected}")
                loss = loss_of(model, 2)
                check(abs(loss - resumed["losses"][0]) <= 1e-5 * abs(loss),
                      f"after load_model, PyTorch's loss on step 2's batch {loss:.7f} = shardlab's "
                      f"{resumed['losses'][0]:.7f}")
                # save_model keeps one name of the tie by its own rule: the name that sorts first, lm_head.weight,
                # which is not the first registered (what shardlab saves).
                theirs = gpt(11)
                hf_file = os.path.join(tmp, "save_model.safetensors")
                save_model(theirs, hf_file)
                with safe_open(hf_file, framework="pt") as f:
                    keys = set(f.keys())
                check("lm_head.weight" in keys and "wte.weight" not in keys,
                      f"save_model kept the tie as lm_head.weight only: {len(keys)} tensors, "
                      f"lm_head.weight {'lm_head.weight' in keys}, wte.weight {'wte.weight' in keys}")
                for strategy, world in (("single", "1"), ("fsdp", "2")):
                    started = train(tmp, f"from_save_model_{strategy}", "--strategy", strategy, "--world-size", world,
                                    "--steps", "1", *common, "--resume", hf_file)
                    expected = loss_of(theirs, 0)
                    check(abs(started["losses"][0] - expected) <= 1e-5 * abs(expected),
                          f"{strategy}: shardlab's first loss from save_model's file {started['losses'][0]:.7f} = "
                          f"PyTorch's {expected:.7f}")

    # ---- 3. kills ----------------------------------------------------------------------------------------------------
    if "kills" not in PARTS:
        print("skip: the kills (part 3), as asked")
    else:
        def descendants(root):
            children = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(pid))
            out, todo = [], [root]
            while todo:
                for c in children.get(todo.pop(), []):
                    out.append(c)
                    todo.append(c)
            return out

        def rank_process(root, rank):
            for pid in descendants(root):
                try:
                    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                if b"worker" in cmd and f"RANK={rank}".encode() in env:
                    return pid
            return None

        def whole_and_loadable(path, what):
            exported = os.path.join(tmp, "check.safetensors")
            p = subprocess.run([SHARDLAB, "export", path, exported], capture_output=True, text=True, timeout=120)
            check(p.returncode == 0, f"{what}: the checkpoint passes every check ({(p.stdout + p.stderr).strip()[-300:]})")
            return int(read_safetensors(exported)[1]["step"]) if p.returncode == 0 else 0

        def same_checkpoints(a, b):  # every tensor, the optimizer's too, bit for bit
            ta, tb = read_sharded(a)[0], read_sharded(b)[0]
            return set(ta) == set(tb) and all(np.array_equal(ta[k], tb[k]) for k in ta)

        live = os.path.join(tmp, "live")
        endless = ["--strategy", "fsdp", "--world-size", "2", "--model", "mlp", "--steps", "100000", "--global-batch", "8",
                   "--save", live, "--save-every", "1"]

        class Job:
            """`shardlab train` in the background; its output read by a thread, so that no wait blocks on a pipe."""

            def __init__(self, *extra):
                env = dict(os.environ, TMPDIR=tmp)  # what a killed driver leaves goes with the test's directory
                self.p = subprocess.Popen([SHARDLAB, "train", *endless, *extra], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
                self.lines = queue.Queue()
                self.out = []
                self.reader = threading.Thread(target=self._read, daemon=True)
                self.reader.start()

            def _read(self):
                for line in self.p.stdout:
                    self.out.append(line)
                    self.lines.put(line)
                self.lines.put(None)

            def wait_for_saves(self, count, timeout=120):
                seen, deadline = 0, time.time() + timeout
                while seen < count and time.time() < deadline:
                    try:
                        line = self.lines.get(timeout=max(0.1, deadline - time.time()))
                    except queue.Empty:
                        break
                    if line is None:
                        break
                    seen += "saved checkpoint" in line
                return seen

            def kill_all(self):  # the driver and every rank: nothing outlives the test
                alive = self.p.poll() is None
                for pid in [*([self.p.pid] if alive else []), *descendants(self.p.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.p.wait(timeout=60)
                self.reader.join(timeout=30)  # every line read

        job = Job()
        try:
            check(job.wait_for_saves(3) == 3, "the job saves a checkpoint after every step")
            victim = rank_process(job.p.pid, 1)
            check(victim is not None, f"found rank 1's process ({victim})")
            killed_at = time.time()
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
            code = job.p.wait(timeout=120)
            took = time.time() - killed_at
            job.reader.join(timeout=30)
            out = "".join(job.out)
            check(code != 0 and re.search(r"rank 1\b|killed by signal 9", out) is not None,
                  f"a killed rank stops the job ({took:.1f} s, exit {code}) naming it: {out.strip()[-300:]!r}")
        finally:
            job.kill_all()

        def resumes_bit_for_bit(what):
            # The killed job's checkpoint, one step on, against an uninterrupted run to the same step: bit for bit
            # (same world size and strategy), the optimizer's state included.
            s = whole_and_loadable(live, what)
            common_mlp = ["--strategy", "fsdp", "--world-size", "2", "--model", "mlp", "--global-batch", "8",
                          "--steps", str(s + 1)]
            resumed_run = train(tmp, "resumed_run", *common_mlp, "--resume", live, "--save", os.path.join(tmp, "res"))
            train(tmp, "straight_run", *common_mlp, "--save", os.path.join(tmp, "ref"))
            check(resumed_run["first_step"] == s and same_checkpoints(os.path.join(tmp, "res"), os.path.join(tmp, "ref")),
                  f"{what}: resumed at step {s}, one step on it equals the uninterrupted run bit for bit")

        resumes_bit_for_bit("after rank 1 was killed")

        rng = random.Random(20)
        for attempt in range(4):
            job = Job("--resume", live)
            try:
                saved = job.wait_for_saves(1)
                check(saved == 1, f"attempt {attempt + 1}: the resumed job loaded the checkpoint and saved again")
                time.sleep(rng.uniform(0.0, 0.05))  # saves run back to back: a random moment is as likely inside one
            finally:
                job.kill_all()
            whole_and_loadable(live, f"the whole job killed at a random moment (attempt {attempt + 1})")
        resumes_bit_for_bit("after the last kill")

if errors:
    sys.exit("FAILED:\n  " + "\n  ".join(errors))
print("test_checkpoints: all passed")
