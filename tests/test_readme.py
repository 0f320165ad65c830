"""Every training command in the code blocks of README and docs/{slurm,optimizer,checkpoints,context-parallel,moe,...}.md
runs as written: it parses,
builds its model config and passes the layout validation for the world size it launches, checked
in-process without training. The CI test command after its marker is what .ci/run reads."""
import re
import shlex
from pathlib import Path

import pytest

from megalite import arguments
from megalite.runtime import UsageError

ROOT = Path(__file__).resolve().parent.parent
DOC_NAMES = ("slurm", "optimizer", "checkpoints", "context-parallel", "activation-memory", "planner",
             "local-sgd", "communication", "configuration", "moe", "deepseek", "sft", "data", "wandb")
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in DOC_NAMES)]
ENTRIES = {"pretrain_gpt.py": "gpt-tiny", "pretrain_bert.py": "bert-tiny"}
# What scripts/slurm/*.sbatch put before the job's own flags (its `defaults` array).
SBATCH_DEFAULTS = ["--metrics-file", "run/metrics.jsonl", "--save", "ckpt", "--load", "ckpt", "--save-interval", "1000"]


def code_block_lines(text: str) -> list[str]:
    """Lines of the fenced code blocks, continuation lines (trailing backslash) joined."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def _flag(tokens: list[str], *names: str, default: str | None = None) -> str | None:
    for i, token in enumerate(tokens):
        for name in names:
            if token == name:
                return tokens[i + 1]
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
    return default


def training_command(line: str):
    """(entry point, world size, argv) of a torchrun or sbatch command line; None for other lines."""
    if "pretrain_" not in line:  # also keeps shlex away from Python and output lines
        return None
    commands = [[]]
    for token in shlex.split(line, comments=True):  # `a && b`: look at each command on its own
        if token in (">", "|"):  # the command's output redirected or piped: not its arguments
            break
        if token in ("&&", ";"):
            commands.append([])
        else:
            commands[-1].append(token)
    for words in commands:
        env = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if re.match(r"^[A-Z_]+=", w)}
        words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        at = next((i for i, w in enumerate(words) if Path(w).name.split(".")[0] + ".py" in ENTRIES
                   and Path(w).suffix in (".py", ".sbatch")), None)
        if not words or at is None:
            continue
        launcher, script, argv = words[:at], words[at], words[at + 1:]
        entry = Path(script).name.split(".")[0] + ".py"
        if not launcher:  # a file listing, not a command
            continue
        if launcher[0] == "sbatch":
            nodes = int(_flag(launcher, "-N", "--nodes", default="1"))
            per_node = _flag(launcher, "--gpus-per-node", default=env.get("MEGALITE_NPROC_PER_NODE"))
            assert per_node is not None, f"{line}: ranks per node unknown (--gpus-per-node or MEGALITE_NPROC_PER_NODE)"
            return entry, nodes * int(per_node), SBATCH_DEFAULTS + argv
        if launcher[0] != "torchrun" and "torch.distributed.run" not in launcher and "megalite.launch" not in launcher:
            return entry, int(env.get("WORLD_SIZE", 1)), argv  # python pretrain_gpt.py: one process (or --print-config's)
        world = int(_flag(launcher, "--nproc_per_node", "--nproc-per-node", default="1"))
        return entry, world * int(_flag(launcher, "--nnodes", default="1")), argv
    return None


def check_command(entry: str, world: int, argv: list[str]) -> int:
    """Parse and validate as the entry point would, before any process starts; returns dp."""
    argv = [str(ROOT / a) if i and argv[i - 1] == "--config" else a for i, a in enumerate(argv)]  # files in the repo
    args = arguments.build_parser("check", default_model=ENTRIES[entry]).parse_args(argv)
    return arguments.validate(args, world, arguments.model_config(args))


def documented_commands():
    found = []
    for doc in DOCS:
        for line in code_block_lines(doc.read_text()):
            command = training_command(line)
            if command:
                found.append(pytest.param(*command, id=f"{doc.name}: {' '.join(line.split())[:90]}"))
    return found


@pytest.mark.parametrize("entry, world, argv", documented_commands())
def test_documented_training_command_is_valid_for_its_world_size(entry, world, argv):
    try:
        check_command(entry, world, argv)
    except (UsageError, SystemExit) as e:
        pytest.fail(f"{entry} {' '.join(argv)} on {world} ranks: {e}")


def test_readme_shows_quickstart_and_interleaved_runs():
    commands = [c for c in (training_command(line) for line in code_block_lines((ROOT / "README.md").read_text())) if c]
    assert ("pretrain_gpt.py", 4, ["--tp", "2", "--pp", "2"]) in commands
    assert any("--vpp" in argv for _, _, argv in commands), "README should show an interleaved run"


def test_the_check_refuses_interleaving_the_default_model_over_too_many_stages():
    # gpt-tiny's 4 layers do not fill 4 x 2 virtual stages: the mistake the checks above exist for.
    entry, world, argv = training_command("torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --pp 4 --vpp 2")
    with pytest.raises(UsageError, match="layers"):
        check_command(entry, world, argv)
    assert check_command(entry, world, argv + ["--num-layers", "8"]) == 1


def test_cpu_torch_is_installed_before_the_package_and_ci_command_follows_its_marker():
    text = (ROOT / "README.md").read_text()
    lines = code_block_lines(text.split("## Quickstart", 1)[1])
    first = {what: next(i for i, line in enumerate(lines) if what in line)
             for what in ("pip install torch==2.13.0", "pip install -e .")}
    assert first["pip install torch==2.13.0"] < first["pip install -e ."], "the CPU build must come first"
    assert "download.pytorch.org" not in text, "that index is unreachable from megalite's machines"
    after_marker = text.split("<!-- ci:test-command -->\n", 1)[1].splitlines()
    assert after_marker[:3] == ["```bash", 'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder', "```"]
