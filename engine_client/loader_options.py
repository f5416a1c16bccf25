"""The options of vLLM's ``weight_cache`` load format (``--model-loader-extra-config``), kept
apart from the loader so they can be checked without vLLM installed."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine_client.client import DEFAULT_TIMEOUT_S, ClientConfig


class LoaderOptions(BaseModel):
    """``--model-loader-extra-config`` keys; anything else is refused. Where the daemon is and
    the token (``url``, ``uds``, ``token``, ``token_file``) beat the client's settings from the
    environment (:class:`~protocol.client_settings.ClientSettings`), as a client command's flags
    do."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    uds: str | None = None
    token: str | None = None
    token_file: str | None = None
    model: str | None = None
    fallback: bool = True
    timeout: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    wait: float = Field(default=0.0, ge=0)
    verify_checksums: bool = False
    donate: bool | None = Field(
        default=None,
        description="attach to a donated model, else load with vLLM and donate: by default "
        "for checkpoints the daemon does not process; true for any, false for none",
    )
    handle_socket: str | None = Field(
        default=None,
        description="the daemon's handle socket, if not at the path its grants name "
        "(<run_dir>/handles.sock as the daemon sees it)",
    )
    identity: Literal["files", "sampled", "hf_blob", "full"] = Field(
        default="sampled",
        description="how the engine's checkpoint must match the daemon's (docs/engines.md: "
        "identity tiers)",
    )
    park: bool | Literal["if_serving"] = Field(
        default=False,
        description="wait at the load step (holding only the CUDA context) until the daemon "
        "releases this engine: an engine on the same model ended, or an operator asked; "
        "'if_serving': wait only while another engine holds a lease on the model",
    )
    park_timeout: float | None = Field(
        default=None,
        gt=0,
        description="seconds to wait parked before falling back or failing (default: for ever)",
    )
    startup_slot_timeout: float = Field(
        default=600.0,
        ge=0,
        description="seconds to wait for this GPU's start-up slot before starting without it "
        "(0: do not ask)",
    )

    @property
    def parks_if_serving(self) -> bool:
        return self.park == "if_serving"

    def client_config(self) -> ClientConfig:
        return ClientConfig.from_env(
            self.token_file,
            url=self.url,
            uds=self.uds,
            token=self.token,
            timeout_s=self.timeout,
            handle_socket=self.handle_socket,
        )
