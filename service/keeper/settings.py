"""The keeper's own setting (``weight-cache keeper --idle-timeout``, variable
``WEIGHT_CACHE_KEEPER_IDLE_TIMEOUT``), declared as every setting is
(:func:`protocol.setting.setting`), so its option, its variable and the settings table agree."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.setting import ENV_PREFIX, setting


class KeeperSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", env_ignore_empty=True, populate_by_name=True
    )

    idle_timeout: float = setting(
        600.0,
        flag="--keeper-idle-timeout",
        also=("--idle-timeout",),
        help="Seconds a keeper (`weight-cache keeper`, or the one serve --keeper auto starts) "
        "waits without a daemon before it lets go of everything and exits (0: never)",
        ge=0,
    )
