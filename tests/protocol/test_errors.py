"""Every error code says what to do, the same way in the API, the CLI and the README's table."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import run_cli
from protocol.errors import UnauthorizedError, VerificationError, error_classes, error_from_problem
from protocol.reasons import Reason

README = Path(__file__).resolve().parents[2] / "docs" / "operating.md"  # the operator's guide
ABSTRACT = {"invalid_checkpoint", "conflict"}  # bases of other codes, never raised as such


def troubleshooting_table() -> dict[str, tuple[str, str]]:
    """code -> (HTTP status cell, what-to-do cell) from the README's table."""
    rows: dict[str, tuple[str, str]] = {}
    section = README.read_text().split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for code in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[code] = (cells[1], cells[3])
    return rows


def test_every_code_has_advice_and_a_readme_row() -> None:
    table = troubleshooting_table()
    classes = error_classes()
    codes = set(classes) - ABSTRACT
    assert set(table) == codes, set(table) ^ codes
    # every code words its own advice (none inherits its base's), and the bases give none
    assert {c for c, cls in classes.items() if "hint" in vars(cls) and cls.hint} == codes
    for code, (status, advice) in table.items():
        assert advice == classes[code].hint, code  # the table says what the daemon says
        assert str(classes[code].status) in status, code


def test_problem_documents_carry_the_hint_and_clients_keep_it_apart() -> None:
    error = UnauthorizedError("no token")
    body = error.problem_fields()
    assert body["hint"] == UnauthorizedError.hint
    back = error_from_problem(body, 401)
    assert type(back) is UnauthorizedError and "hint" not in back.extra
    assert back.explain(cli=True).endswith(UnauthorizedError.cli_hint)
    assert "WEIGHT_CACHE_TOKEN" in back.explain(cli=True) and "--token-file" in back.explain(True)


def test_an_error_takes_a_reason_and_the_wire_carries_its_value() -> None:
    error = VerificationError("two TP sizes", reason=Reason.tp_mismatch, tp_size=2)
    body = json.loads(json.dumps(error.problem_fields()))
    assert body["reason"] == "tp_mismatch" and error.reason is Reason.tp_mismatch
    back = error_from_problem(body, error.status)
    assert type(back) is VerificationError and back.reason is Reason.tp_mismatch
    assert str(back) == "[verification_failed] two TP sizes (tp_size=2)"


def test_the_cli_tells_its_user_how_to_pass_a_token(tmp_path: Path, tiny_fp8: Path) -> None:
    from harness.daemon_process import start_daemon

    (tmp_path / "token").write_text("secret-1\n")
    (tmp_path / "token").chmod(0o600)  # the daemon refuses a token file others may read
    daemon = start_daemon(tmp_path, [tiny_fp8], "--token-file", str(tmp_path / "token"))
    try:
        out = run_cli("status", "--url", daemon.url, timeout=60)
    finally:
        daemon.stop()
    assert out.returncode == 1
    assert "[unauthorized]" in out.stderr and "pass --token-file FILE" in out.stderr


OPEN_CHILD = """
import sys
from modelopt_fp8.checkpoint import Checkpoint
from protocol.errors import WeightCacheError
try:
    Checkpoint.open(sys.argv[1]).close()
except WeightCacheError as exc:
    print(exc.code, exc.status, exc.extra.get("file"))
"""


def open_unprivileged(path: Path) -> str:
    """Open a checkpoint in a child that file permissions apply to (root drops the capabilities
    that let it read anything)."""
    import os

    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop the read-anything capability")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]
    out = subprocess.run(
        [*prefix, sys.executable, "-c", OPEN_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "hf_quant_config.json"])
def test_an_unreadable_file_is_permission_denied(tiny_fp8: Path, copy_of, name: str) -> None:
    ckpt = copy_of(tiny_fp8)
    (ckpt / name).chmod(0)
    assert open_unprivileged(ckpt) == f"permission_denied 403 {ckpt / name}"
    (ckpt / name).chmod(0o644)
    assert open_unprivileged(ckpt) == ""
