"""The README stays true and short: its commands exist and print what it shows (a real daemon on
the demo model, as `make run` starts it), its links lead somewhere, and its lead quotes only
figures measured in at least two runs, each with its card."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.cli import run_cli
from harness.daemon_process import start_daemon, stop_keeper
from protocol.version import __version__
from weight_cache_cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def console_block(after: str) -> str:
    """The first console block after the text ``after``."""
    rest = README[README.index(after) :]
    return rest.split("```console\n", 1)[1].split("```", 1)[0]


def shown_output(command: str, block: str) -> list[str]:
    """The lines a console block shows for ``$ command``, up to the next prompt."""
    lines = block.splitlines()
    start = lines.index(f"$ {command}") + 1
    out = []
    for line in lines[start:]:
        if line.startswith("$ "):
            break
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def test_short_and_linked() -> None:
    assert len(README.splitlines()) < 300
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target
    for doc in ("operating", "engines", "reference", "benchmarks"):
        assert f"(docs/{doc}.md)" in README, doc


RUNS = re.compile(r"\b(two|three|four|five|six|[2-9]|\d{2,}) runs\b")


def test_the_lead_quotes_figures_of_two_runs_with_their_card() -> None:
    """Every claim of the lead, timed or counted (requests lost), names its card and two or
    more runs; the one-run table, in its own section, names its card and says it is one run."""
    lead = README.split("\n## ", 1)[0]
    assert "not yet run" not in README and "one of two runs" not in README
    claims = [item.split("\n\n", 1)[0] for item in lead.split("\n- ")[1:]]
    assert len(claims) >= 3 and all(re.search(r"\d", claim) for claim in claims)
    for claim in claims:
        assert re.search(r"\bH[12]00\b", claim), claim
        assert RUNS.search(claim), claim
    assert "\n|" not in lead  # no table in the lead
    section = README.split("\n## One run, side by side\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n\n|", 1)[0]  # what is said above the table
    assert "One run" in table and re.search(r"\bH[12]00\b", table), table


def test_every_make_target_and_command_it_names_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    for target in set(re.findall(r"`make ([a-z-]+)", README)) | {"run", "demo", "test", "dist"}:
        assert target in targets, target
    for line in re.findall(r"(?:`|\.venv/bin/)weight-cache ([a-z-]+[^\n`'\"]*)", README):
        name, *words = line.split()
        command = cli.commands.get(name)
        assert command is not None, line
        options = {o for p in command.params for o in getattr(p, "opts", [])}
        for word in words:
            if word.startswith("--"):
                assert word.split("=")[0] in options, (name, word)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`make run`'s daemon: the demo model, a keeper of its own, on a port of its own."""
    tmp = tmp_path_factory.mktemp("first-run")
    run_dir = tmp / "run"
    daemon = start_daemon(tmp, [], run_dir=run_dir, keeper="auto", timeout_s=120)
    try:
        yield daemon.url, run_dir
    finally:
        daemon.stop()
        stop_keeper(run_dir)


def shown_cli(*args: str) -> str:
    """What ``weight-cache ARGS`` prints on an 80-column terminal."""
    return run_cli(*args, env={"COLUMNS": "80"}, check=True).stdout


def test_the_first_run_prints_what_the_readme_shows(first_run: tuple[str, Path]) -> None:
    url, run_dir = first_run
    block = console_block("### A first run")
    (shown_health,) = shown_output("curl -s localhost:8470/health", block)
    health = httpx.get(f"{url}/health").json()
    assert list(health) == re.findall(r'"(\w+)":', shown_health)
    assert health["version"] == __version__ and f'"version":"{__version__}"' in shown_health

    status = shown_cli("status", "--url", url).splitlines()
    shown = shown_output(".venv/bin/weight-cache status", block)
    assert re.sub(r"boot \w+", "boot B", status[0]) == re.sub(r"boot \w+", "boot B", shown[0])
    keeper = re.escape(shown[1]).replace("4242", r"\d+")
    keeper = keeper.replace(re.escape("/run/weight-cache"), re.escape(str(run_dir)))
    assert re.fullmatch(keeper, status[1]), (shown[1], status[1])
    headers = [" ".join(line.split()) for line in shown if line.startswith("┃")]
    assert headers == [" ".join(line.split()) for line in status if line.startswith("┃")]
    (demo_row,) = [line for line in status if line.startswith("│ demo")]
    assert demo_row in shown

    attach = shown_cli("attach", "--url", url, "--check").splitlines()
    shown = shown_output(".venv/bin/weight-cache attach --check", block)
    assert [line.split(":")[0] for line in attach] == [line.split(":")[0] for line in shown]
    measured = ("lease_ms", "attach_ms", "open_ms", "rebuild_ms", "verify_ms", "disk_load_ms")
    for got, want in zip(attach, shown, strict=True):
        if got.split(":")[0].strip() not in measured:
            assert got == want


def test_keeper_stop_as_shown() -> None:
    """The line `keeper --stop` prints (tests/weight_cache_cli/test_lifecycle.py runs it)."""
    block = console_block("**Stopping it.**")
    (shown,) = shown_output(".venv/bin/weight-cache keeper --stop", block)
    assert re.fullmatch(
        r"stopped the keeper \(pid \d+\) on /run/weight-cache/keeper\.sock; it let go of demo",
        shown,
    )
