"""Every command the docs show runs as pasted: each shell block of docs/CLI.md (every ``` block
without a language), line by line in a scratch directory, with the project's virtualenv first on
PATH; and the README's tour shows only commands that docs/CLI.md runs. A plain `larql …` line
(environment assignments at most before it, no other shell syntax) runs through the CLI app in
this process, as the `larql` script calls it, without an interpreter start each; every other
line (a pipe, `larql serve`, a `--tensor-parallel` run, curl) runs the installed script through
bash, as does test_cli.py's `test_console_script_runs`. A `larql serve` line is left running in
the background (as in another terminal) until its block ends; a line ending in `&` too.
`notes.txt`, the corpus the apollo example indexes, is the first part of the shipped licence
text. A few commands run here with the same flags and fewer new tokens (`-n`) than pasted, where
what they show does not depend on the count: FEWER_TOKENS names them.

The bench and accuracy examples take minutes each; they run in `make test-all` (marked long)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from larql.cli.app import app
from larql.data import default_text
from larql.kv.resolve import ENV_VAR

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "CLI.md"
LONG_BLOCKS = ("larql bench", "larql accuracy")  # headings of blocks that take minutes
STARTUP_S = 180
NOTES_CHARS = 3000  # of the licence: ~700 tokens, a store of eleven 64-token windows

# a docs command (its words, as shlex.join spells them) → the `-n` it runs with here: the same
# flags, fewer new tokens; the behaviour each shows (a stdin prompt, a predicted walk, frames
# archived and resumed, a saved state loaded, ranks, another model) is there at that count
FEWER_TOKENS = {
    "echo 'Once upon a time' '|' larql run - -n 32 -v": 8,
    "larql run 'Once upon a time' -n 16 -m gemma3-270m": 4,
    "larql run ' Q: Who wrote it? A:' -n 16 --load-state doc.state": 4,
    "larql run 'The capital of France is' -n 16 --tensor-parallel 3": 4,
    "larql walk 'The capital of France is' --predict -n 16 --engine markov-rs -k 1024": 4,
    # 32 new tokens on the 4-token prompt: two 16-token frames to list and resume
    "larql run 'Once upon a time' -n 64 --engine boundary-kv:chunk_tokens=16,archive=frames/": 32,
    "larql run 'Once upon a time' -n 64 --engine"
    " boundary-kv:chunk_tokens=16,archive=frames/,sequence_id=story": 32,
    "larql run ' Then the dragon' -n 32 --engine boundary-kv:chunk_tokens=16,archive=frames/"
    " --resume story": 8,
}


def shell_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(heading, commands) of every plain ``` block of `text` (a block with a language, e.g.
    ```text, is not a script); a command whose quotes are still open continues on the next
    line."""
    blocks: list[tuple[str, list[str]]] = []
    heading, inside, script, commands = "", False, False, []
    for line in text.splitlines():
        if line.startswith("#") and not inside:
            heading = line.lstrip("#").strip()
        elif line.startswith("```"):
            if inside and script:
                blocks.append((heading, commands))
            inside, script, commands = not inside, line.strip() == "```", []
        elif inside and script and line.strip() and not line.startswith("#"):
            if commands and not closed(commands[-1]):
                commands[-1] += "\n" + line
            else:
                commands.append(line.strip())
    return blocks


def closed(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # an open quote
        return False
    return True


def is_long(heading: str) -> bool:
    return heading.strip("`").startswith(LONG_BLOCKS)


def block_id(heading: str) -> str:
    return re.sub(r"[^a-z-]+", "-", heading.split("—")[0].strip("` ").lower()).strip("-")


BLOCKS = shell_blocks(CLI_DOC.read_text())


def words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


N_FLAG = re.compile(r"(?<= )-n \d+(?= )")


def as_run(command: str) -> str:
    """`command` as this test runs it: with FEWER_TOKENS's `-n` where it names the command."""
    fewer = FEWER_TOKENS.get(shlex.join(words(command)))
    return command if fewer is None else N_FLAG.sub(f"-n {fewer}", command, count=1)


def test_fewer_tokens_names_docs_commands_and_changes_only_their_count() -> None:
    pasted = {shlex.join(words(c)): c for _, commands in BLOCKS for c in commands}
    for key, fewer in FEWER_TOKENS.items():
        assert key in pasted, f"{key!r} is no docs/CLI.md command"
        doc, run = words(pasted[key]), words(as_run(pasted[key]))
        at = doc.index("-n") + 1
        assert run[:at] + run[at + 1 :] == doc[:at] + doc[at + 1 :]  # the same flags
        assert int(run[at]) == fewer < int(doc[at])


def test_every_command_section_has_examples() -> None:
    headings = [h for h, _ in BLOCKS]
    for command in (
        "larql run",
        "larql walk",
        "larql serve",
        "larql engines",
        "larql models",
        "larql bench",
        "larql accuracy",
        "larql apollo",
        "larql boundary",
    ):
        assert any(command in h for h in headings), command


def test_the_readme_tour_shows_commands_the_cli_doc_runs() -> None:
    tour = README.read_text().split("\n## Tour\n", 1)[1].split("\n## ", 1)[0]
    ((_, shown),) = shell_blocks(tour)
    run = [words(c) for _, commands in BLOCKS for c in commands]
    assert len(shown) >= 6
    for command in shown:
        assert words(command) in run, f"README's tour shows {command!r}, which docs/CLI.md lacks"


@pytest.mark.parametrize(
    "heading, commands",
    [
        pytest.param(h, c, id=block_id(h), marks=[pytest.mark.long] if is_long(h) else [])
        for h, c in BLOCKS
    ],
)
@pytest.mark.slow
def test_cli_doc_block_runs_as_pasted(
    heading: str, commands: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notes.txt").write_text(default_text()[:NOTES_CHARS])
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    background: list[subprocess.Popen[bytes]] = []
    try:
        for command in map(as_run, commands):
            server = command.startswith("larql serve")
            if command.endswith("&") or server:
                background.append(start(command.rstrip("& "), tmp_path, env))
                if server and "--ffn-only" not in command:
                    wait_for_health(command, background[-1])
                continue
            plain = plain_larql(command)
            if plain is not None:
                assignments, args = plain
                result = CliRunner().invoke(app, args, env=assignments)
                shown = f"{command}\n{result.output[-1600:]}"
                assert result.exit_code == 0, shown
                assert result.exception is None or isinstance(result.exception, SystemExit), shown
                continue
            done = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True
            )
            shown = f"{command}\n{done.stdout[-800:]}{done.stderr[-800:]}"
            assert done.returncode == 0, shown
            assert "Traceback" not in done.stderr, shown
            if command.startswith("curl"):
                assert '"choices"' in done.stdout, shown
    finally:
        for proc in background:
            proc.terminate()
            proc.wait(30)


SHELL_SYNTAX = re.compile(r"[$`|&;<>(){}*?\[\]~\\]")  # outside quotes: bash's to run
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def plain_larql(command: str) -> tuple[dict[str, str], list[str]] | None:
    """A plain `larql …` line's environment assignments and arguments; None for any other line
    (other shell syntax, `larql serve`, a tensor-parallel run): bash runs those."""
    command = command.replace("\\\n", " ")  # a continued line
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "''", command).split("#", 1)[0]
    if SHELL_SYNTAX.search(unquoted):
        return None
    args = words(command)
    assignments: dict[str, str] = {}
    while args and ASSIGNMENT.match(args[0]):
        name, value = args.pop(0).split("=", 1)
        assignments[name] = value
    if args[:1] != ["larql"] or args[1:2] == ["serve"] or "--tensor-parallel" in args:
        return None
    return assignments, args[1:]


def test_plain_larql_lines_are_told_from_shell_ones() -> None:
    assert plain_larql('LARQL_KV_ENGINE=no-cache larql run "Hi; there?" -n 8  # a note') == (
        {"LARQL_KV_ENGINE": "no-cache"},
        ["run", "Hi; there?", "-n", "8"],
    )
    assert plain_larql('larql run "The" \\\n  -n 1') == ({}, ["run", "The", "-n", "1"])
    for shell in (
        'echo "Once" | larql run - -n 32',
        "mkdir x && larql models",
        "larql models > out.txt",
        "larql run $PROMPT",
        "larql serve --port 8080",
        "larql run Hi --tensor-parallel 3",
        "curl -s localhost:8080/health",
    ):
        assert plain_larql(shell) is None, shell


def start(command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_health(command: str, proc: subprocess.Popen[bytes]) -> None:
    port = re.search(r"--port (\d+)", command)
    url = f"http://127.0.0.1:{port.group(1) if port else 8080}/health"
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{command} exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.25)
    raise AssertionError(f"{command}: no answer at {url} within {STARTUP_S} s")
