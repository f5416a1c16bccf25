"""Token files, read one way by the daemon's settings and by every client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from engine_client.client import ClientConfig
from protocol.errors import UnauthorizedError
from protocol.tokens import choose_token, read_token_file, resolve_token
from service.settings import DaemonSettings


@pytest.fixture(autouse=True)
def private_files() -> Iterator[None]:
    """Token files written here are 0600, as the daemon requires of them."""
    old = os.umask(0o077)
    yield
    os.umask(old)


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
    """Given beats the environment; within each, a file beats a value."""
    (tmp_path / "given").write_text("given-file\n")
    (tmp_path / "env").write_text("env-file\n")
    monkeypatch.setenv("WEIGHT_CACHE_TOKEN", "env-value")
    assert ClientConfig.from_env().token == "env-value"
    monkeypatch.setenv("WEIGHT_CACHE_TOKEN_FILE", str(tmp_path / "env"))
    assert ClientConfig.from_env().token == "env-file"
    assert ClientConfig.from_env(token="value").token == "value"
    assert ClientConfig.from_env(str(tmp_path / "given")).token == "given-file"
    assert ClientConfig.from_env(str(tmp_path / "given"), token="value").token == "given-file"


@pytest.mark.parametrize("env_value", [None, "env-value"])
@pytest.mark.parametrize("env_file", [False, True])
@pytest.mark.parametrize("flag_file", [False, True])
def test_daemon_and_client_pick_the_same_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env_value, env_file, flag_file
) -> None:
    """A daemon and a client started with the same variables and --token-file agree."""
    (tmp_path / "flag").write_text("flag-file\n")
    (tmp_path / "env").write_text("env-file\n")
    if env_value:
        monkeypatch.setenv("WEIGHT_CACHE_TOKEN", env_value)
    if env_file:
        monkeypatch.setenv("WEIGHT_CACHE_TOKEN_FILE", str(tmp_path / "env"))
    flag = tmp_path / "flag" if flag_file else None
    given: dict[str, Any] = {"token_file": flag} if flag else {}  # as `serve` passes flags
    daemon = DaemonSettings(**given).token
    client = ClientConfig.from_env(str(flag) if flag else None).token
    assert (daemon.get_secret_value() if daemon else None) == client


@pytest.mark.parametrize(
    ("given_value", "given_file", "environ", "expected"),
    [
        (None, None, {}, (None, None)),
        (None, None, {"WEIGHT_CACHE_TOKEN": "ev"}, ("ev", None)),
        (None, None, {"WEIGHT_CACHE_TOKEN": "ev", "WEIGHT_CACHE_TOKEN_FILE": "ef"}, (None, "ef")),
        ("gv", None, {"WEIGHT_CACHE_TOKEN": "ev", "WEIGHT_CACHE_TOKEN_FILE": "ef"}, ("gv", None)),
        ("gv", "gf", {"WEIGHT_CACHE_TOKEN_FILE": "ef"}, (None, "gf")),
        (None, "gf", {"WEIGHT_CACHE_TOKEN": "ev"}, (None, "gf")),
        ("", None, {"WEIGHT_CACHE_TOKEN": "ev", "WEIGHT_CACHE_TOKEN_FILE": ""}, ("ev", None)),
    ],
)
def test_the_one_token_rule(given_value, given_file, environ, expected) -> None:
    """Given beats the environment; within each, a file beats a value; empty is not given."""
    assert choose_token(given_value, given_file, environ) == expected


def test_resolve_reads_the_chosen_file_only(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("from-file\n")
    environ = {"WEIGHT_CACHE_TOKEN_FILE": str(tmp_path / "missing")}
    assert resolve_token("given", None, environ) == "given"  # the env file is never opened
    assert resolve_token(None, tmp_path / "t", environ) == "from-file"


@pytest.mark.parametrize("given_value", [None, "given-value"])
@pytest.mark.parametrize("env_file", [False, True])
@pytest.mark.parametrize("env_value", [None, "env-value"])
def test_a_given_value_counts_the_same_on_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given_value, env_file, env_value
) -> None:
    """A value handed to the daemon's settings and to a client in code beats both variables."""
    (tmp_path / "env").write_text("env-file\n")
    if env_value:
        monkeypatch.setenv("WEIGHT_CACHE_TOKEN", env_value)
    if env_file:
        monkeypatch.setenv("WEIGHT_CACHE_TOKEN_FILE", str(tmp_path / "env"))
    given: dict[str, Any] = {"token": SecretStr(given_value)} if given_value else {}
    daemon = DaemonSettings(**given).token
    client = ClientConfig.from_env(token=given_value).token
    assert (daemon.get_secret_value() if daemon else None) == client


def test_a_token_file_every_user_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("s3cret-token\n")
    path.chmod(0o644)
    with pytest.raises(ValidationError, match=r"readable by every user \(mode 0644\)"):
        DaemonSettings(token_file=path)
    path.chmod(0o640)  # a group may read it (compose secrets, a service group)
    assert DaemonSettings(token_file=path).token is not None


@pytest.mark.parametrize("token", ["t\u00f6ken-0123456789abcdef", "tok en", "tok\x01en"])
def test_a_token_no_header_can_carry_is_refused_on_both_sides(
    tmp_path: Path, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token no HTTP header can carry (non-ASCII, spaces, control bytes) is refused up front
    on both sides, typed, saying why, instead of failing as the client encodes its first
    request."""
    with pytest.raises(ValidationError, match="visible ASCII"):
        DaemonSettings(token=SecretStr(token))
    monkeypatch.setenv("WEIGHT_CACHE_TOKEN", token)
    with pytest.raises(UnauthorizedError, match="visible ASCII"):
        ClientConfig.from_env()
    (tmp_path / "t").write_text(token)
    with pytest.raises(UnauthorizedError, match="visible ASCII"):
        read_token_file(tmp_path / "t")


def test_a_whitespace_token_is_refused_by_client_and_daemon_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon refuses a token of whitespace alone; a client given one refuses it too,
    instead of sending a bearer header with nothing in it."""
    with pytest.raises(ValidationError, match="whitespace only"):
        DaemonSettings(token=SecretStr("   "))
    monkeypatch.setenv("WEIGHT_CACHE_TOKEN", "   ")
    with pytest.raises(UnauthorizedError, match="whitespace only"):
        ClientConfig.from_env()
