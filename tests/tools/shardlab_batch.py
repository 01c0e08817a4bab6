"""shardlab's command lines in one process: shardlab_cli_batch (tests/tools/cli_batch.cpp) calls the function that
`shardlab`'s main() calls once per command line, so libtorch loads once, not once per command."""
import json
import subprocess


def run_batch(batch, commands):
    """Runs `commands` (argument lists, without the program) in one `batch --batch` process: one (exit code, output)
    per command, in order, the output being what it wrote to stdout and stderr. A batch that dies early answers the
    rest with code None and its own output, so each of them fails naming it."""
    lines = "".join(json.dumps(args) + "\n" for args in commands)
    p = subprocess.run([batch, "--batch"], input=lines, capture_output=True, text=True)
    answers = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    died = f"shardlab_cli_batch exited with {p.returncode} after {len(answers)} commands: {p.stderr}"
    return [(a["code"], a["output"]) for a in answers] + [(None, died)] * (len(commands) - len(answers))
