"""Token files, read one way by the daemon's settings and by every client."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from engine_client.client import ClientConfig
from service.errors import UnauthorizedError
from service.settings import DaemonSettings
from service.tokens import read_token_file


def test_token_is_stripped(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("  tok-1\n")
    assert read_token_file(tmp_path / "t") == "tok-1"


@pytest.mark.parametrize("content", [None, "", " \n"])
def test_missing_or_empty_file_is_refused(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "t"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UnauthorizedError) as err:
        read_token_file(path)
    assert str(path) in err.value.detail


def test_daemon_settings_take_the_file_over_a_value(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("from-file\n")
    settings = DaemonSettings(token=SecretStr("value"), token_file=tmp_path / "t")
    assert settings.token is not None and settings.token.get_secret_value() == "from-file"
    (tmp_path / "t").write_text("\n")
    with pytest.raises(ValidationError, match="is empty"):
        DaemonSettings(token_file=tmp_path / "t")


def test_client_token_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "given").write_text("given-file\n")
    (tmp_path / "env").write_text("env-file\n")
    monkeypatch.setenv("WEIGHT_CACHE_TOKEN_FILE", str(tmp_path / "env"))
    assert ClientConfig.from_env().token == "env-file"
    monkeypatch.setenv("WEIGHT_CACHE_TOKEN", "env-value")
    assert ClientConfig.from_env().token == "env-value"
    assert ClientConfig.from_env(str(tmp_path / "given")).token == "given-file"
    assert ClientConfig.from_env(str(tmp_path / "given"), token="value").token == "value"
