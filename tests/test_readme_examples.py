"""Every command the docs show runs as pasted: each shell block of docs/CLI.md (every ``` block
without a language), line by line through bash, in a scratch directory, with the project's
virtualenv first on PATH; and the README's tour shows only commands that docs/CLI.md runs. A
`larql serve` line is left running in the background (as in another terminal) until its block
ends; a line ending in `&` too. `notes.txt`, the corpus the apollo example indexes, is the
shipped licence text.

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

from larql.data import default_text
from larql.kv.resolve import ENV_VAR

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "CLI.md"
LONG_BLOCKS = ("larql bench", "larql accuracy")  # headings of blocks that take minutes
STARTUP_S = 180


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
def test_cli_doc_block_runs_as_pasted(heading: str, commands: list[str], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text(default_text())
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    background: list[subprocess.Popen[bytes]] = []
    try:
        for command in commands:
            server = command.startswith("larql serve")
            if command.endswith("&") or server:
                background.append(start(command.rstrip("& "), tmp_path, env))
                if server and "--ffn-only" not in command:
                    wait_for_health(command, background[-1])
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
