#!/usr/bin/python3
"""Executes a notebook headless and fails when a cell raises.

    /usr/bin/python3 notebooks/run_notebook.py notebooks/01_naive_ddp.ipynb --in-place
    /usr/bin/python3 notebooks/run_notebook.py NB.ipynb --output OUT.ipynb --workdir DIR   (what ctest runs)

The kernel is the interpreter running this script (a private kernel spec pointing at sys.executable), never
whatever "python3" kernel a user installed, and it starts in the notebook's own directory so the notebooks'
relative paths work. Needs Debian 12's python3-nbclient, python3-ipykernel and python3-matplotlib
(tools/install-deps); run under another interpreter that lacks them, the script re-executes itself under
/usr/bin/python3.
"""

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile
import time

DEBIAN_PYTHON = "/usr/bin/python3"
NEEDED = ("nbclient", "nbformat", "ipykernel", "matplotlib")


def ensure_modules():
    missing = []
    for name in NEEDED:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if not missing:
        return
    if os.path.realpath(sys.executable) != os.path.realpath(DEBIAN_PYTHON) and os.access(DEBIAN_PYTHON, os.X_OK):
        os.execv(DEBIAN_PYTHON, [DEBIAN_PYTHON, os.path.abspath(__file__)] + sys.argv[1:])
    sys.exit(f"run_notebook: {sys.executable} lacks {', '.join(missing)}; install the Debian packages with "
             "tools/install-deps (python3-nbclient python3-ipykernel python3-matplotlib)")


def coalesce_streams(nb):
    """Merges consecutive stdout (or stderr) outputs of a cell into one, as Jupyter shows them."""
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                    and merged[-1].get("name") == out.get("name")):
                merged[-1]["text"] += out["text"]
            else:
                merged.append(out)
        if "outputs" in cell:
            cell["outputs"] = merged


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=pathlib.Path)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--in-place", action="store_true", help="store the outputs in the notebook itself")
    where.add_argument("--output", type=pathlib.Path, help="write the executed notebook here")
    parser.add_argument("--workdir", type=pathlib.Path,
                        help="directory for the tool's JSON and traces (SHARDLAB_NOTEBOOK_OUT); default: temporary")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per cell (default 240)")
    args = parser.parse_args()
    ensure_modules()

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    source = args.notebook.resolve()
    output = source if args.in_place else args.output.resolve()
    nb = nbformat.read(source, as_version=4)

    with tempfile.TemporaryDirectory(prefix="shardlab-nbrun-") as tmp:
        # A private Jupyter data dir whose "python3" kernel is this interpreter; it comes first on JUPYTER_PATH.
        spec_dir = pathlib.Path(tmp, "jupyter", "kernels", "python3")
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (ipykernel)", "language": "python"}))
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(spec_dir.parent.parent),
                                                                   os.environ.get("JUPYTER_PATH")]))
        os.environ["JUPYTER_RUNTIME_DIR"] = str(pathlib.Path(tmp, "runtime"))
        os.environ["IPYTHONDIR"] = str(pathlib.Path(tmp, "ipython"))
        os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the source tree
        os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend draws PNGs, no display needed
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
            os.environ["SHARDLAB_NOTEBOOK_OUT"] = str(args.workdir.resolve())

        client = NotebookClient(nb, kernel_name="python3", timeout=args.timeout, record_timing=False,
                                resources={"metadata": {"path": str(source.parent)}})
        start = time.monotonic()
        failed = None
        try:
            client.execute()
        except CellExecutionError as e:
            failed = e
        elapsed = time.monotonic() - start

    coalesce_streams(nb)
    if failed is None or not args.in_place:  # never overwrite a committed notebook with a failed run
        output.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, output)
    if failed is not None:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(failed))  # the kernel's traceback is colored
        print(f"run_notebook: {source.name} failed after {elapsed:.1f} s:\n{text}", file=sys.stderr)
        return 1
    print(f"run_notebook: {source.name} executed in {elapsed:.1f} s -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
