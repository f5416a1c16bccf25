"""``weight-cache openapi``: print the API contract (the checked-in openapi.json)."""

from __future__ import annotations

import json

import click


def openapi_document() -> dict[str, object]:
    from service.api.app import create_app
    from service.settings import DaemonSettings

    # Defaults only: the contract must not depend on this machine's environment.
    return create_app(DaemonSettings.model_construct()).openapi()


@click.command("openapi")
def openapi() -> None:
    """Print the OpenAPI document of the daemon's REST API."""
    click.echo(json.dumps(openapi_document(), indent=2, sort_keys=True))
