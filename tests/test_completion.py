"""`--print-completion bash`: the script both programs print is one bash reads, and Tab on it
completes their subcommands and choices the way an operator's shell would."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tests.conftest import venv_bin


def completion_script(program: str) -> str:
    return subprocess.run([venv_bin(program), "--print-completion", "bash"], capture_output=True,
                          text=True, timeout=60, check=True).stdout


def tab(program: str, line: str) -> list[str]:
    """What bash offers for Tab at the end of `line`, the script sourced in a real bash and its
    completion function called as bash calls it (COMP_WORDS, COMP_CWORD)."""
    words = line.split(" ")
    function = f"_shtab_{program}"
    shell = (f"source /dev/stdin; COMP_WORDS=({' '.join(map(shlex.quote, words))}); "
             f"COMP_CWORD={len(words) - 1}; COMP_LINE={shlex.quote(line)}; "
             f'COMP_POINT=${{#COMP_LINE}}; {function}; printf "%s\\n" "${{COMPREPLY[@]}}"')
    out = subprocess.run(["bash", "-c", shell], input=completion_script(program),
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("program", ["eagle3ctl", "eagle3d"])
def test_the_completion_script_is_valid_bash(program, tmp_path):
    script = tmp_path / program
    script.write_text(completion_script(program))
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_tab_completes_the_subcommands_and_their_choices():
    assert tab("eagle3ctl", "eagle3ctl st") == ["status"]
    assert "samples" in tab("eagle3ctl", "eagle3ctl ")
    assert tab("eagle3ctl", "eagle3ctl samples --status ver") == ["verified"]
    assert tab("eagle3d", "eagle3d tr") == ["train-node"]
