"""Donated models: who may donate, a donation that would overwrite one held, a device the
daemon cannot hold it on, a commit that is not the donor's or whose bytes do not match what it
says."""

from __future__ import annotations

from protocol.errors.access import ForbiddenError
from protocol.errors.models import ConflictError
from protocol.errors.requests import InvalidRequestError, NotFoundError


class DonationNotAllowedError(ForbiddenError):
    """A donation from a caller the daemon does not trust to write what other engines compute
    with."""

    code = "donation_not_allowed"
    title = "Caller may not donate"
    hint = (
        "donate as the daemon's own user or root; a token holder may donate only where the "
        "daemon runs with --allow-token-donations"
    )


class DonationExistsError(ConflictError):
    """A donation of a key already held or being donated: a donated model is never
    overwritten."""

    code = "donation_exists"
    title = "This donated model is already held or being donated"
    hint = (
        "attach to it (the loader does); to replace it, unload it first with DELETE /v1/models/{id}"
    )


class DonationNotFoundError(NotFoundError):
    code = "donation_not_found"
    title = "No pending donation by this id"
    hint = "ask for an arena again with POST /v1/donations; a pending donation ends with its donor"


class DonationSecretError(ForbiddenError):
    """A commit or abandon without the secret the offer gave its donor."""

    code = "donation_not_yours"
    title = "Donation made by another caller"
    hint = "only the caller that asked for a donation's arena commits or abandons it"


class DonationInvalidError(InvalidRequestError):
    """A commit whose tensors do not fit the arena offered, or whose bytes do not match the
    checksums it names."""

    code = "donation_invalid"
    title = "Donated tensors do not match their arena or checksums"
    hint = "donate again; a donation whose bytes were changed while it was written is refused"


class DonationDeviceError(ConflictError):
    """A donation whose arena would live on a device this daemon does not hold arenas on: a GPU
    donation to a daemon on the CPU, on another GPU, or lending GPU arenas over legacy IPC."""

    code = "donation_device"
    title = "The daemon cannot hold this donation on the donor's device"
    hint = (
        "a GPU donation needs a daemon on that GPU (--device cuda, cuda:N naming it, or auto on a "
        "host with GPUs) lending arenas as descriptors (--cuda-handles fd); the engine serves "
        "its own load meanwhile"
    )
