"""Settings as an operator gives them: environment variables named after the flags, sizes with
units, unknown variables refused (clients finding the daemon from the same variables:
tests/engine_client/test_client.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine_client.engine_api import SLEEP_FLAG
from harness.checkpoint_tools import hub_snapshot
from modelopt_fp8.checkpoint.locate import locate_checkpoint
from protocol.errors import CheckpointNotFoundError, error_classes
from protocol.setting import setting_of
from service.env import SETTINGS_MODELS, check_environment, env_names, known_variables
from service.settings import DaemonSettings
from weight_cache_cli import cli
from weight_cache_cli.serve import SettingsError, build_settings
from weight_cache_cli.settings_table import with_table

README = Path(__file__).resolve().parents[2] / "docs" / "operating.md"  # the operator's guide


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("WEIGHT_CACHE_") or name.startswith("HF_"):
            monkeypatch.delenv(name)


def test_model_and_allowed_root_take_plain_paths(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WEIGHT_CACHE_MODEL", "/models/a")
    monkeypatch.setenv("WEIGHT_CACHE_ALLOWED_ROOT", f"{tmp_path}:/srv/models")
    settings = DaemonSettings()
    assert settings.models == [Path("/models/a")]
    assert settings.allowed_roots == [tmp_path, Path("/srv/models")]
    monkeypatch.setenv("WEIGHT_CACHE_MODEL", "/models/a:/models/b")
    assert DaemonSettings().models == [Path("/models/a"), Path("/models/b")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("40GiB", 40 << 30), ("512MB", 512_000_000), ("512MiB", 512 << 20), ("123456", 123456)],
)
def test_memory_budget_takes_sizes(monkeypatch, value: str, expected: int) -> None:
    monkeypatch.setenv("WEIGHT_CACHE_MEMORY_BUDGET", value)
    assert DaemonSettings().memory_budget_bytes == expected
    monkeypatch.delenv("WEIGHT_CACHE_MEMORY_BUDGET")
    monkeypatch.setenv("WEIGHT_CACHE_MEMORY_BUDGET_BYTES", value)  # the older name still works
    assert DaemonSettings().memory_budget_bytes == expected
    assert build_settings(memory_budget_bytes=value).memory_budget_bytes == expected


def test_a_flag_wins_over_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("WEIGHT_CACHE_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("WEIGHT_CACHE_PORT", "9000")
    assert DaemonSettings().tp_size == 2
    settings = build_settings(tp_size=4, models=())
    assert settings.tp_size == 4 and settings.port == 9000


def test_a_bad_value_is_one_line_naming_the_flag_and_variable(monkeypatch) -> None:
    with pytest.raises(SettingsError) as err:
        build_settings(memory_budget_bytes="12XB")
    assert err.value.exit_code == 2 and "\n" not in err.value.message
    assert err.value.message.startswith("--memory-budget / WEIGHT_CACHE_MEMORY_BUDGET")
    monkeypatch.setenv("WEIGHT_CACHE_PORT", "eighty")
    with pytest.raises(SettingsError, match=r"^--port / WEIGHT_CACHE_PORT: "):
        build_settings()


def test_unknown_variables_are_refused_with_the_closest_name() -> None:
    check_environment({"WEIGHT_CACHE_PORT": "1", "PATH": "/bin"})
    with pytest.raises(
        ValueError, match=r"WEIGHT_CACHE_MODLE \(did you mean WEIGHT_CACHE_MODEL\?\)"
    ):
        check_environment({"WEIGHT_CACHE_MODLE": "/m"})
    with pytest.raises(ValueError, match=r"did you mean WEIGHT_CACHE_MODEL\?"):
        check_environment({"WEIGHT_CACHE_MODELS": "/m"})  # the old JSON-only name
    with pytest.raises(ValueError, match="WEIGHT_CACHE_XYZZY;"):
        check_environment({"WEIGHT_CACHE_XYZZY": "1"})


def test_the_command_refuses_an_unknown_variable() -> None:
    result = CliRunner().invoke(cli, ["status"], env={"WEIGHT_CACHE_PROT": "9000"})
    assert result.exit_code == 2
    assert "WEIGHT_CACHE_PROT (did you mean WEIGHT_CACHE_PORT?)" in result.output


def test_every_variable_is_in_the_help_and_the_readme() -> None:
    serve_help = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200).output
    top_help = CliRunner().invoke(cli, ["--help"], terminal_width=200).output
    attach_help = CliRunner().invoke(cli, ["attach", "--help"], terminal_width=200).output
    readme_table = set(re.findall(r"`(WEIGHT_CACHE_[A-Z_]+)`", README.read_text()))
    for field in DaemonSettings.model_fields:
        for name in env_names(field):
            assert name in " ".join(serve_help.split()), name
    for name in ("WEIGHT_CACHE_LOG_LEVEL", "WEIGHT_CACHE_LOG_FORMAT"):
        assert name in top_help
    for name in ("WEIGHT_CACHE_URL", "WEIGHT_CACHE_UDS", "WEIGHT_CACHE_TOKEN_FILE"):
        assert name in attach_help
    assert set(known_variables()) <= readme_table, set(known_variables()) - readme_table
    assert readme_table <= set(known_variables()), readme_table - set(known_variables())


def test_a_repo_id_resolves_through_the_local_hub_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as err:
        locate_checkpoint("nvidia/Llama-3.1-8B-Instruct-FP8")
    assert "huggingface-cli download nvidia/Llama-3.1-8B-Instruct-FP8" in err.value.detail
    assert str(tmp_path / "hf" / "hub") in err.value.detail
    snapshot = hub_snapshot(tmp_path / "hf" / "hub", "nvidia/Llama-3.1-8B-Instruct-FP8")
    assert locate_checkpoint("nvidia/Llama-3.1-8B-Instruct-FP8") == snapshot.resolve()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # wins over HF_HOME
    with pytest.raises(CheckpointNotFoundError):
        locate_checkpoint("nvidia/Llama-3.1-8B-Instruct-FP8")


def test_paths_are_made_absolute(monkeypatch, tmp_path: Path, tiny_fp8: Path) -> None:
    monkeypatch.chdir(tiny_fp8.parent)
    settings = build_settings(models=(tiny_fp8.name,))
    assert settings.models == [tiny_fp8.resolve()]
    with pytest.raises(SettingsError, match=r"^--model: checkpoint directory /.*/nope does not"):
        build_settings(models=("./nope",))


def test_the_readme_table_is_the_one_the_settings_make() -> None:
    """Run `make settings-table` when this fails: the README's table is made from the model."""
    readme = README.read_text()
    assert with_table(readme) == readme


def _another_value(field: str) -> str | None:
    """A valid value for ``field`` other than its default (None: not a plain scalar)."""
    info = DaemonSettings.model_fields[field]
    default = info.get_default(call_default_factory=True)
    if field == "device":
        return "cpu"
    if info.annotation is bool:
        return str(not default).lower()
    if info.annotation in (int, float):
        return str(default + 1)
    if info.annotation is str:
        return "0.0.0.0"
    return None  # paths, sizes, tokens: read as the tests above read them


@pytest.mark.parametrize(
    "field", [f for f in DaemonSettings.model_fields if _another_value(f) is not None]
)
def test_every_variable_of_a_setting_sets_it(monkeypatch, field: str) -> None:
    """Each variable the options' help names is one pydantic reads, older spellings included."""
    value = str(_another_value(field))
    for name in setting_of(DaemonSettings.model_fields[field]).variables:
        monkeypatch.setenv(name, value)
        assert str(getattr(DaemonSettings(), field)).lower() in (value, f"{value}.0")
        monkeypatch.delenv(name)


def test_every_flag_and_variable_an_error_names_is_a_setting() -> None:
    """Hints name flags and variables as text where the model is out of reach (``protocol``
    cannot import the daemon's settings): each must still be one a settings model declares."""
    flags = {
        flag
        for model in SETTINGS_MODELS
        for field in model.model_fields.values()
        for described in [setting_of(field)]
        for flag in (*described.flags, *(f"--no-{f[2:]}" for f in described.flags))
    }
    variables = set(known_variables())
    # vLLM's own flag a hint may name (tests/vllm/test_engine_api.py holds it to vLLM).
    flags.add(SLEEP_FLAG)
    named: dict[str, set[str]] = {}
    for code, cls in error_classes().items():
        for text in (cls.hint, getattr(cls, "cli_hint", None) or ""):
            named.setdefault(code, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
            named[code].update(re.findall(r"WEIGHT_CACHE_[A-Z_]+", text))
    unknown = {
        code: sorted(n for n in names if n not in flags and n not in variables)
        for code, names in named.items()
    }
    assert {code: names for code, names in unknown.items() if names} == {}
