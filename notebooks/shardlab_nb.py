"""Helpers shared by the shardlab notebooks: run the `shardlab` tool, read its JSON report and Chrome traces, draw
the three figures (loss beside the reference, bytes per step beside theory, a timeline of one step), and for FSDP
(notebooks 04 and 05) the parameter memory held over one step.

Only the tool's documented outputs are read:
  - `shardlab train ... --json FILE`: one object (losses, reference_losses, bytes_per_step, ...);
  - `shardlab train ... --trace DIR`: DIR/rank{r}.trace.json, Chrome trace format. Track (tid) 1 "compute" holds
    the spans forward / backward / optimizer (args.step) and the "wait: ..." spans nested inside them (the time the
    training thread waited for communication: DDP's "ddp sync" at the end of backward; FSDP's "fsdp unshard" for
    every all-gather, in forward and backward, "fsdp reduce" for a reduce-scatter, "fsdp sync" at the end of
    backward); tracks 2, 3, ... "comm k" hold one span per collective, from launch to completion (args: op,
    wire_dtype, bytes, ...).
    FSDP runs add counter events "fsdp memory" (ph "C", args param_bytes and grad_bytes): the bytes the FSDP layer
    holds after every allocation and free.

Environment:
  SHARDLAB_BIN           the tool (default: ../build/default/bin/shardlab, relative to this directory);
  SHARDLAB_NOTEBOOK_OUT  where runs write their JSON and traces (default: a new temporary directory).
"""

import json
import os
import pathlib
import shlex
import subprocess
import tempfile

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

LABELS = {
    "single": "single device",
    "naive_ddp": "naive DDP",
    "bucketed_ddp": "bucketed DDP",
    "hook_allreduce": "hook: fp32 all-reduce",
    "hook_fp16": "hook: fp16 compression",
    "hook_bf16": "hook: bf16 compression",
    "fsdp": "FSDP",
    "fsdp_prefetch": "FSDP with prefetch",
    "hsdp": "HSDP",
}
COMPUTE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
WAIT_COLOR = "#c44e52"
OP_COLORS = {"all_gather": "#8172b3", "reduce_scatter": "#937860", "all_reduce": "#4c72b0"}

_workdir = None


def tool():
    """Path of the shardlab binary ($SHARDLAB_BIN, else the default build)."""
    path = pathlib.Path(os.environ.get("SHARDLAB_BIN") or HERE / ".." / "build" / "default" / "bin" / "shardlab")
    if not path.is_file():
        raise FileNotFoundError(
            f"shardlab tool not found at {path}. Build it (cd {REPO} && cmake --preset default && "
            "cmake --build build/default --target shardlab) or point SHARDLAB_BIN at it.")
    return path.resolve()


def shown(path):
    """`path` relative to the repository when it lies inside it (for printing)."""
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def workdir():
    """Directory the runs write into ($SHARDLAB_NOTEBOOK_OUT, else one temporary directory per kernel)."""
    global _workdir
    if _workdir is None:
        out = os.environ.get("SHARDLAB_NOTEBOOK_OUT")
        if out:
            _workdir = pathlib.Path(out)
            _workdir.mkdir(parents=True, exist_ok=True)
        else:
            _workdir = pathlib.Path(tempfile.mkdtemp(prefix="shardlab-notebook-"))
    return _workdir


def tool_help():
    return subprocess.run([str(tool()), "--help"], capture_output=True, text=True, timeout=60).stdout


def train(strategy, *, name=None, trace=False, world_size=2, model="tiny_gpt", steps=10, global_batch=8, seed=1,
          layers=2, **flags):
    """Runs `shardlab train --strategy STRATEGY ...` and returns its JSON report as a dict.

    `layers` is the tiny GPT's number of blocks (2 here, the model notebooks 01-03 describe; the tool's default is
    4). Extra keyword arguments become flags (bucket_cap_kb=32 -> --bucket-cap-kb 32; for fsdp_prefetch,
    prefetch_depth=2, prefetch_limit=2 -> --prefetch-depth 2 --prefetch-limit 2). With trace=True the run also
    writes Chrome traces; the report then carries "trace_dir". The command is printed so it can be rerun by hand
    (from the directory it prints).
    """
    name = name or strategy
    out = workdir()
    args = ["train", "--strategy", strategy, "--world-size", str(world_size), "--model", model,
            "--steps", str(steps), "--global-batch", str(global_batch), "--seed", str(seed)]
    if model == "tiny_gpt":  # notebooks 01-03 were drawn (figures, text) for the 2-block tiny GPT; 04 asks for more
        args += ["--layers", str(layers)]
    for key, value in flags.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    args += ["--json", f"{name}.json"]
    if trace:
        args += ["--trace", f"{name}.trace"]
    print("$ shardlab " + " ".join(shlex.quote(a) for a in args))
    proc = subprocess.run([str(tool())] + args, cwd=out, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"shardlab exited with {proc.returncode} (in {out}):\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    with open(out / f"{name}.json") as f:
        report = json.load(f)
    report["name"] = name
    if trace:
        report["trace_dir"] = str(out / f"{name}.trace")
    return report


def label(run):
    if run.get("label"):
        return run["label"]
    if run["strategy"] == "fsdp":
        return "FSDP, " + ("reshard after forward" if run.get("reshard_after_forward", True) else
                           "keep after forward")
    if run["strategy"] == "fsdp_prefetch":   # the tool reports the limit in force: the depth unless set, at least 1
        depth, limit = run["prefetch_depth"], run["prefetch_limit"]
        return f"FSDP, prefetch depth {depth}" + (f", limit {limit}" if limit != max(depth, 1) else "")
    if run["strategy"] == "hsdp":
        accumulating = run.get("micro_batches", 1) > 1
        return f"HSDP {run['mesh']}" + ((", all-reduce deferred" if run.get("defer_all_reduce") else ", no_sync")
                                        if accumulating else "")
    return LABELS.get(run["strategy"], run["strategy"])


def max_loss_diff(run):
    return max(abs(a - b) for a, b in zip(run["losses"], run["reference_losses"]))


def table(runs, columns):
    """Prints one row per run: columns is a list of (header, function of the run, format)."""
    rows = [[label(r)] + [format(fn(r), fmt) for _, fn, fmt in columns] for r in runs]
    heads = ["run"] + [h for h, _, _ in columns]
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(heads))
    for row in rows:
        print(line(row))


# --- figures from the JSON report -----------------------------------------------------------------------------


def plot_losses(runs, title="Loss per step"):
    """Left: each run's loss (mean over ranks) over the single-device reference. Right: |loss - reference|."""
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(11, 3.6))
    steps = range(len(runs[0]["reference_losses"]))
    ax.plot(steps, runs[0]["reference_losses"], color="black", linewidth=5, alpha=0.25,
            label="single device (reference)")
    for r in runs:
        ax.plot(steps, r["losses"], marker="o", markersize=3, linewidth=1.2,
                label=f"{label(r)}, {r['world_size']} ranks")
        diff = [max(abs(a - b), 1e-12) for a, b in zip(r["losses"], r["reference_losses"])]
        ax_diff.semilogy(steps, diff, marker="o", markersize=3, linewidth=1.2, label=label(r))
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend(fontsize=8)
    ax_diff.set(xlabel="step", ylabel="|loss - reference|", title="Distance to the reference (log scale)",
                ylim=(1e-9, 1))
    ax_diff.axhline(1e-4, color="gray", linestyle=":", linewidth=1)
    ax_diff.legend(fontsize=8)
    fig.tight_layout()
    plt.show()


def plot_bytes(runs, title="Bytes per step, rank 0"):
    """Measured bytes per step (what rank 0 handed to the collectives) beside the strategy's theory."""
    fig, ax = plt.subplots(figsize=(1.9 * len(runs) + 3, 3.6))
    width = 0.38
    for i, r in enumerate(runs):
        measured, theory = r["bytes_per_step"] / 1024, r["bytes_per_step_theory"] / 1024
        b1 = ax.bar(i - width / 2, measured, width, color="#4c72b0", label="measured" if i == 0 else None)
        b2 = ax.bar(i + width / 2, theory, width, color="#bbbbbb", hatch="//", edgecolor="white",
                    label="theory" if i == 0 else None)
        ax.bar_label(b1, fmt="%.1f", fontsize=8)
        ax.bar_label(b2, fmt="%.1f", fontsize=8)
    names = [f"{label(r)}\n{r['collectives_per_step']:g} collectives/step" for r in runs]
    ax.set_xticks(range(len(runs)), names, fontsize=8)
    ax.set(ylabel="KiB per step", title=title)
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    plt.show()


# --- Chrome traces --------------------------------------------------------------------------------------------


class Trace:
    """One rank's trace: its complete ("X") events, counter ("C") events and track names; times in ms from the
    first complete event."""

    def __init__(self, path):
        with open(path) as f:
            data = json.load(f)
        events = data["traceEvents"]
        self.tracks = {e["tid"]: e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == "thread_name"}
        spans = [e for e in events if e.get("ph") == "X"]
        t0 = min(e["ts"] for e in spans)
        for e in spans:
            e["start"] = (e["ts"] - t0) / 1e3
            e["end"] = e["start"] + e["dur"] / 1e3
        self.spans = sorted(spans, key=lambda e: e["start"])
        counters = [e for e in events if e.get("ph") == "C"]
        for e in counters:
            e["start"] = (e["ts"] - t0) / 1e3
        self.counters = sorted(counters, key=lambda e: e["start"])

    def compute(self, step=None, name=None):
        return [e for e in self.spans if e.get("cat") == "compute" and (name is None or e["name"] == name)
                and (step is None or e.get("args", {}).get("step") == step)]

    def steps(self):
        return sorted({e["args"]["step"] for e in self.compute() if "step" in e.get("args", {})})

    def window(self, step):
        spans = self.compute(step)
        if not spans:
            raise ValueError(f"no compute span of step {step} in the trace")
        return min(e["start"] for e in spans), max(e["end"] for e in spans)

    def within(self, start, end, cat):
        return [e for e in self.spans if e.get("cat") == cat and start <= e["start"] < end]

    def counter_at(self, t, name="fsdp memory", key="param_bytes"):
        """A counter's value held at time t: its last sample at or before t."""
        before = [e for e in self.counters if e["name"] == name and key in e.get("args", {}) and e["start"] <= t]
        if not before:
            raise ValueError(f"no '{name}' sample before {t:.3f} ms: was this an FSDP run?")
        return before[-1]["args"][key]

    def counter_before(self, t, name="fsdp memory", key="param_bytes"):
        """A counter's value just before its last change at or before t: what was held before the allocation or free
        that led up to t (before an all-gather's own buffer, at its launch)."""
        before = [e for e in self.counters if e["name"] == name and key in e.get("args", {}) and e["start"] <= t]
        if len(before) < 2:
            raise ValueError(f"no '{name}' sample before the last one at {t:.3f} ms")
        return before[-2]["args"][key]

    def counter_max(self, start, end, name="fsdp memory", key="param_bytes"):
        """The highest value a counter held over [start, end)."""
        return max([self.counter_at(start, name, key)] +
                   [e["args"][key] for e in self.counters
                    if e["name"] == name and key in e.get("args", {}) and start < e["start"] < end])

    def counter(self, start, end, name="fsdp memory", key="param_bytes"):
        """A counter's value over [start, end] as a step function: (times, values), beginning with the value held
        at `start` (the last sample before it) and ending with the value held at `end`."""
        samples = [e for e in self.counters if e["name"] == name and key in e.get("args", {})]
        before = [e for e in samples if e["start"] <= start]
        if not before:
            raise ValueError(f"no '{name}' sample before {start:.3f} ms: was this an FSDP run?")
        times, values = [start], [before[-1]["args"][key]]
        for e in samples:
            if start < e["start"] <= end:
                times.append(e["start"])
                values.append(e["args"][key])
        times.append(end)
        values.append(values[-1])
        return times, values


def load_trace(run, rank=0):
    if not run.get("trace_dir"):
        raise ValueError(f"run {run['name']} was not traced (train(..., trace=True))")
    return Trace(pathlib.Path(run["trace_dir"]) / f"rank{rank}.trace.json")


def _union(intervals):
    total, last = 0.0, None
    for a, b in sorted(intervals):
        if last is None or a > last:
            total += b - a
            last = b
        elif b > last:
            total += b - last
            last = b
    return total


def step_summary(trace, step):
    """What happened on this rank in one step, from the trace (times in ms)."""
    start, end = trace.window(step)
    backward = trace.compute(step, "backward")
    waits = trace.within(start, end, "wait")
    comms = trace.within(start, end, "comm")
    all_reduces = [e for e in comms if e["name"] == "all_reduce"]
    forward = trace.compute(step, "forward")
    last_bw = backward[-1] if backward else None
    # Backward computes gradients until the training thread starts its last wait for communication: the sync at the
    # end of backward (FSDP also waits inside backward, for each all-gather and before each reduce-scatter).
    inner = [w for w in waits if last_bw and last_bw["start"] <= w["start"] <= last_bw["end"]]
    compute_end = inner[-1]["start"] if inner else (last_bw["end"] if last_bw else end)
    waited_in = lambda spans: sum(w["dur"] for w in waits
                                  if any(sp["start"] <= w["start"] <= sp["end"] for sp in spans)) / 1e3
    return {
        "step": step,
        "start": start,
        "end": end,
        "step_ms": end - start,
        "backward_ms": sum(e["dur"] for e in backward) / 1e3,
        "backward_compute_end": compute_end,
        "all_reduces": len(all_reduces),
        "other_collectives": len(comms) - len(all_reduces),
        "all_gathers": sum(1 for e in comms if e["name"] == "all_gather"),
        "reduce_scatters": sum(1 for e in comms if e["name"] == "reduce_scatter"),
        "comm_bytes": sum(e["args"].get("bytes", 0) for e in comms),   # every collective of the step, any op
        "launched_during_backward": sum(1 for e in all_reduces if e["start"] <= compute_end),
        "bytes": sum(e["args"].get("bytes", 0) for e in all_reduces),
        "dtypes": sorted({e["args"].get("dtype") for e in all_reduces}),
        "wire_dtypes": sorted({e["args"].get("wire_dtype") for e in all_reduces}),
        "comm_busy_ms": _union([(max(e["start"], start), min(e["end"], end)) for e in comms]),
        "exposed_ms": sum(e["dur"] for e in waits) / 1e3,
        "exposed_forward_ms": waited_in(forward),     # FSDP: the waits for the all-gathers in forward
        "exposed_backward_ms": waited_in(backward),
        "waits_inside_backward": all(any(b["start"] <= w["start"] and w["end"] <= b["end"] + 1e-3
                                         for b in backward) for w in waits),
    }


def typical_step(run, rank=0, skip=2, key="exposed_ms"):
    """The step whose `key` (a field of step_summary; default: the time spent waiting for communication) is the
    median over the traced steps, skipping the first `skip` (setup) and the last (the trace is written right after
    it and may lack its last collective): a step that is neither lucky nor unlucky, for pictures of noisy runs."""
    trace = load_trace(run, rank)
    steps = trace.steps()[skip:-1] or trace.steps()
    ranked = sorted((step_summary(trace, s)[key], s) for s in steps)
    return ranked[len(ranked) // 2][1]


def trace_summary(run, rank=0, skip=2):
    """Means over the steps of a traced run, skipping the first `skip` steps (setup, bucket rebuild)."""
    trace = load_trace(run, rank)
    steps = trace.steps()
    rows = [step_summary(trace, s) for s in steps[skip:] or steps]
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    return {k: mean(k) for k in ("step_ms", "backward_ms", "comm_busy_ms", "exposed_ms", "all_reduces")}


def _pack_lanes(spans):
    """Assigns each span (sorted by start) the first sub-row where it overlaps nothing; returns the sub-rows."""
    ends, rows = [], []
    for e in spans:
        for i, last in enumerate(ends):
            if e["start"] >= last:
                ends[i] = e["end"]
                rows.append(i)
                break
        else:
            ends.append(e["end"])
            rows.append(len(ends) - 1)
    return rows


def _op_rows(comms):
    """lanes="op": one row per collective op (all_gather, reduce_scatter, ...), with sub-rows where spans of the
    same op overlap. Returns [(op, sub-row, spans)] in display order, top first."""
    order = [op for op in OP_COLORS if any(e["name"] == op for e in comms)]
    order += sorted({e["name"] for e in comms} - set(order))
    rows = []
    for op in order:
        spans = [e for e in comms if e["name"] == op]
        lanes = _pack_lanes(spans)
        for lane in range(max(lanes) + 1):
            rows.append((op, lane, [e for e, l in zip(spans, lanes) if l == lane]))
    return rows


def plot_timeline(runs, step=None, rank=0, title="One training step of rank {rank}", lanes="each"):
    """One axes per run: rank `rank`'s step `step` (default: the last; a list gives one step per run). The top row
    is the training thread; below it the collectives of the step, each bar from launch to completion (time spent
    queued behind earlier collectives included): with lanes="each", one row per collective in launch order; with
    lanes="op", one row per kind of collective (all_gather, reduce_scatter, ...), split only where two of a kind
    overlap, and for FSDP runs each bar is labelled with its unit (see fsdp_step). Returns the step summaries (see
    step_summary)."""
    if lanes not in ("each", "op"):
        raise ValueError(f"lanes must be 'each' or 'op', not {lanes!r}")
    runs = runs if isinstance(runs, list) else [runs]
    traces = [load_trace(r, rank) for r in runs]
    wanted = step if isinstance(step, (list, tuple)) else [step] * len(runs)
    picked = [t.steps()[-1] if s is None else s for t, s in zip(traces, wanted)]
    if lanes == "op":
        counts = [len(_op_rows(t.within(*t.window(s), "comm"))) + 1 for t, s in zip(traces, picked)]
    else:
        counts = [len(t.within(*t.window(s), "comm")) for t, s in zip(traces, picked)]
    heights = [1.2 + 0.16 * max(n, 3) for n in counts]
    fig_height = 1.0 + sum(heights)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, fig_height), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    summaries = []
    longest = 0.0
    cmap = plt.get_cmap("tab10")
    for ax, run, trace, s in zip(axes[:, 0], runs, traces, picked):
        info = step_summary(trace, s)
        summaries.append(info)
        t0, t1 = info["start"], info["end"]
        longest = max(longest, t1 - t0)
        comms = trace.within(t0, t1, "comm")
        if lanes == "op":
            if run["strategy"] in ("fsdp", "fsdp_prefetch"):
                _name_fsdp_units(trace, s)
            op_rows = _op_rows(comms)
            n = len(op_rows)
        else:
            n = len(comms)
        top = n + 1.5   # the compute row sits at y = top, collective k (or row k) at y = n - k
        for e in trace.compute(s):
            ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (top - 0.6, 1.2),
                           color=COMPUTE_COLORS.get(e["name"], "gray"))
        for w in trace.within(t0, t1, "wait"):
            ax.broken_barh([(w["start"] - t0, w["end"] - w["start"])], (top - 0.4, 0.8), facecolor=WAIT_COLOR,
                           edgecolor="white", hatch="////")
        ticks, names = [top], ["compute"]
        k_reduce = 0
        for k, (op, lane, spans) in enumerate(op_rows if lanes == "op" else []):
            y = n - k
            for j, e in enumerate(spans):
                ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y - 0.4, 0.8),
                               facecolor=OP_COLORS.get(op, "lightgray"), edgecolor="white", linewidth=0.6,
                               alpha=1.0 if j % 2 == 0 else 0.75)
            _label_bars(ax, spans, y, t0, t1 - t0)
            ticks.append(y)
            kib = sorted({round(e["args"].get("bytes", 0) / 1024, 1) for e in spans})
            names.append(f"{op}{' (overlapping)' if lane else ''}: {len(spans)} x "
                         f"{'/'.join(f'{b:g}' for b in kib)} KiB")
        for k, e in enumerate(comms if lanes == "each" else []):
            y = n - k
            a = e.get("args", {})
            if e["name"] == "all_reduce":
                style = dict(facecolor=cmap(k_reduce % 10), edgecolor="black", linewidth=0.4)
                name = f"all_reduce {k_reduce}"
                k_reduce += 1
            else:
                style = dict(facecolor="lightgray", edgecolor="gray", hatch="..")
                name = e["name"]
            ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y - 0.4, 0.8), **style)
            if n <= 12:
                ticks.append(y)
                names.append(f"{name}: {a.get('bytes', 0) / 1024:.1f} KiB {a.get('wire_dtype', '')}")
            elif k % 5 == 0:
                ticks.append(y)
                names.append(name)
        ax.axvline(info["backward_compute_end"] - t0, color="black", linestyle="--", linewidth=0.8)
        ax.set_yticks(ticks, names, fontsize=7)
        ax.set_ylim(0.3, top + 0.8)
        if lanes == "op":
            done = [f"{c} {op.replace('_', '-')}s" for op, c in _count_ops(comms).items()]
            ax.set_title(f"{label(run)}: step {s}, {', '.join(done)}, "
                         f"{info['exposed_ms']:.2f} ms waiting for communication", fontsize=9, loc="left")
        else:
            ax.set_title(f"{label(run)}: step {s}, {info['all_reduces']} all-reduces, "
                         f"{info['exposed_ms']:.2f} ms waiting for communication", fontsize=9, loc="left")
    for ax in axes[:, 0]:
        ax.set_xlim(0, longest * 1.02)
    axes[-1, 0].set_xlabel("ms since the step's forward began")
    handles = [Patch(color=c, label=n) for n, c in COMPUTE_COLORS.items()]
    handles += [Patch(facecolor=WAIT_COLOR, hatch="////", edgecolor="white", label="waiting for communication")]
    if lanes == "op":
        shown_ops = sorted({e["name"] for t, s in zip(traces, picked) for e in t.within(*t.window(s), "comm")},
                           key=lambda op: list(OP_COLORS).index(op) if op in OP_COLORS else len(OP_COLORS))
        handles += [Patch(facecolor=OP_COLORS.get(op, "lightgray"), label=f"{op}, launch to done")
                    for op in shown_ops]
    else:
        handles += [Patch(facecolor=cmap(0), edgecolor="black", label="all_reduce, launch to done"),
                    Patch(facecolor="lightgray", edgecolor="gray", hatch="..", label="other collective")]
    handles += [plt.Line2D([], [], color="black", linestyle="--", linewidth=0.8, label="backward compute ends")]
    fig.suptitle(title.format(rank=rank), fontsize=10)
    fig.tight_layout(rect=(0, 0.45 / fig_height, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    plt.show()
    return summaries


def _label_bars(ax, spans, y, t0, width, heights=(0.42,)):
    """Writes each span's unit ("root", "0" for block0, ...) above its bar, left-aligned at its launch, shifted right
    where it would run into the previous label; `heights` are cycled through (offsets from y)."""
    last_end = -1e9
    for j, e in enumerate(spans):
        if not e.get("unit"):
            continue
        text = e["unit"].replace("block", "")
        x = max(e["start"] - t0, last_end)
        ax.text(x, y + heights[j % len(heights)], text, fontsize=6, va="bottom", ha="left")
        last_end = x + width * (0.0065 * len(text) + 0.004)


def _count_ops(comms):
    counts = {}
    for e in comms:
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    return counts


# --- FSDP: the schedule and the memory of one step ------------------------------------------------------------


def _name_fsdp_units(trace, step):
    """Splits the step's collectives by FSDP's schedule and names each one's unit (sets e["unit"]): the forward
    gathers the root, then block0 ... block{B-1}; the backward gathers them in reverse (when it resharded them
    after forward) and reduce-scatters block{B-1} ... block0, then the root. The names follow from the launch order
    and that schedule; fsdp_step's callers check the counts and sizes that back them."""
    start, end = trace.window(step)
    forward = trace.compute(step, "forward")
    backward = trace.compute(step, "backward")
    inside = lambda e, spans: any(sp["start"] <= e["start"] <= sp["end"] for sp in spans)
    comms = trace.within(start, end, "comm")
    gathers = [e for e in comms if e["name"] == "all_gather"]
    fwd = [e for e in gathers if inside(e, forward)]
    bwd = [e for e in gathers if inside(e, backward) and not inside(e, forward)]
    scatters = [e for e in comms if e["name"] == "reduce_scatter"]
    blocks = len(fwd) - 1
    for i, e in enumerate(fwd):
        e["unit"] = "root" if i == 0 else f"block{i - 1}"
    for i, e in enumerate(bwd):
        e["unit"] = f"block{blocks - 1 - i}"
    for i, e in enumerate(scatters):
        e["unit"] = "root" if i == len(scatters) - 1 else f"block{blocks - 1 - i}"
    return fwd, bwd, scatters


def fsdp_step(run, step=None, rank=0):
    """FSDP in one traced step of rank `rank` (default: the last step), from the trace:
    forward_gathers, backward_gathers, reduce_scatters: the collectives' spans in launch order, each with its
    "unit"; param_times/param_bytes and grad_times/grad_bytes: the bytes held over the step (the "fsdp memory"
    counter, a step function from the step's start to its end); held_at(t) and held_max(a, b): the parameter bytes
    held at time t and the most held over [a, b); held_before(t): what was held before the last allocation or free at
    or before t (at an all-gather's launch: before its buffer, which is made just before it); waits: the step's wait spans in order; start, end and the compute
    spans (ms)."""
    trace = load_trace(run, rank)
    s = trace.steps()[-1] if step is None else step
    start, end = trace.window(s)
    fwd, bwd, scatters = _name_fsdp_units(trace, s)
    param_times, param_bytes = trace.counter(start, end, key="param_bytes")
    grad_times, grad_bytes = trace.counter(start, end, key="grad_bytes")
    return {
        "step": s, "start": start, "end": end, "compute": trace.compute(s),
        "forward_gathers": fwd, "backward_gathers": bwd, "reduce_scatters": scatters,
        "collectives": trace.within(start, end, "comm"), "waits": trace.within(start, end, "wait"),
        "held_at": lambda t: trace.counter_at(t, key="param_bytes"),
        "held_before": lambda t: trace.counter_before(t, key="param_bytes"),
        "held_max": lambda a, b: trace.counter_max(a, b, key="param_bytes"),
        "param_times": param_times, "param_bytes": param_bytes,
        "grad_times": grad_times, "grad_bytes": grad_bytes,
    }


def plot_memory(runs, replica_bytes=None, step=None, rank=0, title="Parameter bytes held by rank {rank} over one step"):
    """One panel per FSDP run: the parameter bytes its FSDP layer held over one step (the "fsdp memory" counter,
    measured), the run's theory peak (dashed) and, if given, a full replica's bytes (what DDP holds, flat). Under
    each panel a strip with the step's all-gathers and reduce-scatters, launch to done, labelled with their unit,
    so that every step of the curve can be matched with the collective that caused it. `step` as for
    plot_timeline. Returns fsdp_step's dict for each run."""
    runs = runs if isinstance(runs, list) else [runs]
    wanted = step if isinstance(step, (list, tuple)) else [step] * len(runs)
    steps = [fsdp_step(r, s, rank) for r, s in zip(runs, wanted)]
    top = max([max(s["param_bytes"]) for s in steps] + [r["peak_param_bytes_theory"] for r in runs]
              + [replica_bytes or 0]) / 1024 * 1.2
    ratios = []
    for _ in runs:
        ratios += [3.2, 0.75]
    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(11, 0.9 + 4.0 * len(runs)),
                             gridspec_kw={"height_ratios": ratios})
    for i, (run, info) in enumerate(zip(runs, steps)):
        ax, strip = axes[2 * i], axes[2 * i + 1]
        t0 = info["start"]
        for e in info["compute"]:
            for a in (ax, strip):
                a.axvspan(e["start"] - t0, e["end"] - t0, color=COMPUTE_COLORS.get(e["name"], "gray"), alpha=0.08,
                          linewidth=0)
            if e["end"] - e["start"] > 0.1 * (info["end"] - t0):   # too narrow to name: the optimizer
                ax.text((e["start"] + e["end"]) / 2 - t0, top * 0.985, e["name"], ha="center", va="top",
                        fontsize=7, color=COMPUTE_COLORS.get(e["name"], "gray"))
        times = [t - t0 for t in info["param_times"]]
        kib = [b / 1024 for b in info["param_bytes"]]
        ax.step(times, kib, where="post", color="black", linewidth=1.3, label="held (measured)")
        ax.axhline(run["peak_param_bytes_theory"] / 1024, color="#c44e52", linestyle="--", linewidth=1,
                   label=f"theory peak: {run['peak_param_bytes_theory'] / 1024:.1f} KiB")
        ax.axhline(info["param_bytes"][0] / 1024, color="gray", linestyle=":", linewidth=1,
                   label=f"shards only: {info['param_bytes'][0] / 1024:.1f} KiB")
        if replica_bytes:
            ax.axhline(replica_bytes / 1024, color="#55a868", linewidth=2, alpha=0.7,
                       label=f"bucketed DDP, a full replica: {replica_bytes / 1024:.1f} KiB")
        peak = max(info["param_bytes"])
        k = info["param_bytes"].index(peak)
        ax.annotate(f"measured peak {peak / 1024:.1f} KiB", (times[k], peak / 1024),
                    xytext=(10, 8), textcoords="offset points", fontsize=7, va="bottom",
                    arrowprops=dict(arrowstyle="-", color="gray", linewidth=0.6))
        ax.set(ylim=(0, top), xlim=(0, info["end"] - t0), ylabel="KiB")
        ax.set_xticklabels([])
        ax.set_title(f"{label(run)}: step {info['step']}", fontsize=9, loc="left")
        # The legend goes above the curve where there is room, else below the shards (nothing is drawn there), else
        # where matplotlib finds it hides the least.
        if max(info["param_bytes"]) / 1024 / top < 0.6:
            ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1, 0.93), framealpha=0.9)
        else:
            ax.legend(fontsize=7, loc="lower right" if info["param_bytes"][0] / 1024 / top > 0.35 else "best",
                      framealpha=0.9)
        rows = [("all_gather", info["forward_gathers"] + info["backward_gathers"]),
                ("reduce_scatter", info["reduce_scatters"])]
        for y, (op, spans) in zip((1, 0), rows):
            for j, e in enumerate(spans):
                strip.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (y - 0.35, 0.7),
                                  facecolor=OP_COLORS[op], edgecolor="white", linewidth=0.5,
                                  alpha=1.0 if j % 2 == 0 else 0.7)
            _label_bars(strip, spans, y, t0, info["end"] - t0, heights=(0.38,))
        strip.set_yticks([1, 0], [f"all-gathers ({len(rows[0][1])})", f"reduce-scatters ({len(rows[1][1])})"],
                         fontsize=7)
        strip.set(ylim=(-0.5, 1.9), xlim=(0, info["end"] - t0))
        strip.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("ms since the step's forward began (unit labels: root, 0 = block0, 1 = block1, ...)")
    fig.suptitle(title.format(rank=rank), fontsize=10)
    fig.tight_layout()
    plt.show()
    return steps


# --- HSDP (notebook 06) ---------------------------------------------------------------------------------------


def groups_of(run):
    """Rank -> {role: group name} for every group the rank ran a collective on, read from each rank's trace (a
    collective's args.group: "world", "shard(0,1)", "replicate(0,2)")."""
    out = {}
    for rank in range(run["world_size"]):
        names = {e["args"]["group"] for e in load_trace(run, rank).spans if e.get("cat") != "compute"
                 and "group" in e.get("args", {})}
        out[rank] = {name.split("(")[0]: name for name in names}
    return out


def plot_mesh(run, title=None):
    """The mesh as the ranks saw it: one box per rank at (row, column) = (its replicate index, its shard index),
    ranks of one shard group (the rows) joined by a band, ranks of one replicate group (the columns) by a line. Both
    are read from the groups the ranks' collectives ran on, not from the mesh's formula."""
    groups = groups_of(run)
    rows = sorted({g["shard"] for g in groups.values()})
    cols = sorted({g["replicate"] for g in groups.values()})
    pos = {r: (rows.index(g["shard"]), cols.index(g["replicate"])) for r, g in groups.items()}
    fig, ax = plt.subplots(figsize=(2.2 * len(cols) + 2.5, 1.5 * len(rows) + 1))
    for i, name in enumerate(rows):
        ax.add_patch(plt.Rectangle((-0.45, -i - 0.35), len(cols) - 0.1, 0.7, color="#dd8452", alpha=0.25))
        ax.text(len(cols) - 0.4, -i, f"shard group {name}\n(a replica: all-gathers, reduce-scatters)",
                va="center", fontsize=8)
    for j, name in enumerate(cols):
        ax.plot([j, j], [0.3, -len(rows) + 0.7], color="#4c72b0", linewidth=3, alpha=0.6, zorder=1)
        ax.text(j, 0.5, f"replicate group\n{name}\n(all-reduce)", ha="center", fontsize=8, color="#4c72b0")
    for rank, (i, j) in pos.items():
        ax.add_patch(plt.Rectangle((j - 0.3, -i - 0.22), 0.6, 0.44, color="white", ec="black", zorder=2))
        ax.text(j, -i, f"rank {rank}\nshard {j}", ha="center", va="center", fontsize=9, zorder=3)
    ax.set_xlim(-0.6, len(cols) + 1.6)
    ax.set_ylim(-len(rows) + 0.4, 1.1)
    ax.axis("off")
    ax.set_title(title or f"Mesh {run['mesh']} (replicas x shards), as rank traces show it")
    fig.tight_layout()
    plt.show()
    return pos


def plot_group_bytes(runs, title="Bytes per step and group, rank 0, beside theory"):
    """Per run, per group role (world; HSDP: shard, replicate): measured bytes per step beside theory."""
    bars = [(r, role, g) for r in runs for role, g in sorted(r["groups"].items())]
    fig, ax = plt.subplots(figsize=(1.5 * len(bars) + 3, 3.6))
    width = 0.38
    for i, (r, role, g) in enumerate(bars):
        b1 = ax.bar(i - width / 2, g["bytes_per_step"] / 1024, width, color="#4c72b0",
                    label="measured" if i == 0 else None)
        b2 = ax.bar(i + width / 2, g["bytes_per_step_theory"] / 1024, width, color="#bbbbbb", hatch="//",
                    edgecolor="white", label="theory" if i == 0 else None)
        ax.bar_label(b1, fmt="%.1f", fontsize=8)
        ax.bar_label(b2, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(bars)), [f"{label(r)}\n{role}: {g['collectives_per_step']:g}/step" for r, role, g in bars],
                  fontsize=7)
    ax.set(ylabel="KiB per step", title=title)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
