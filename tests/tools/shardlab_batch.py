"""shardlab's command lines in one process: shardlab_cli_batch (tests/tools/cli_batch.cpp) calls the function that
`shardlab`'s main() calls once per command line, so libtorch loads once, not once per command."""
import json
import subprocess


def run_batch(batch, commands):
    """Runs `commands` (argument lists, without the program) in one `batch --batch` process: one (exit code, output)
    per command, in order, the output being what it wrote to stdout and stderr. The batch names each command on this
    process's stderr before running it (a command that hangs is named in the log). Each answer carries its command's
    index and is matched by it; a command without an answer (the batch died, or wrote something else) gets code None
    and says why, and so does every command when the batch itself exits with another code than 0."""
    lines = "".join(json.dumps(args) + "\n" for args in commands)
    p = subprocess.run([batch, "--batch"], input=lines, stdout=subprocess.PIPE, text=True)
    answers = {}
    stray = []
    for line in p.stdout.splitlines():
        try:
            a = json.loads(line)
            answers[a["index"]] = (a["code"], a["output"])
        except (ValueError, KeyError, TypeError):
            stray.append(line)
    why = (f"shardlab_cli_batch exited with {p.returncode} after {len(answers)} of {len(commands)} answers"
           f"{'; it also wrote: ' + repr(stray) if stray else ''}")
    if p.returncode != 0:
        return [(None, why + "\n" + (answers[i][1] if i in answers else "")) for i in range(len(commands))]
    return [answers.get(i, (None, why)) for i in range(len(commands))]
