"""One exception hierarchy for the daemon and the engine side, one module per family.

Every class is one failure mode with a stable ``code`` (what clients switch on), the HTTP
``status`` the API answers with, a ``title`` and a ``hint``: what to do about it, which the
problem document carries, the CLI prints and the troubleshooting table of docs/operating.md
lists (a test keeps the table equal to the classes); ``cli_hint`` words it for a user of the
``weight-cache`` command where that differs. The daemon turns an instance into
``application/problem+json``; the engine-side client turns such a body back into the same class
through :func:`error_from_problem`, so both sides raise the same types.

Families: ``base`` (the base, an unexpected failure, and the registry of codes), ``requests``
(what the API refuses as a request), ``access`` (who may call, and whose leases), ``models``
(the models held and their memory), ``leases``, ``checkpoints``, ``engine`` (reaching the
daemon, verifying and using a lease) and ``parking`` (parked engines and start-up slots).
"""

from protocol.errors.access import (
    ClientNotVisibleError,
    ClientNotYoursError,
    ForbiddenError,
    LeaseNotYoursError,
    PeerNotAllowedError,
    RegistrationNotYoursError,
)
from protocol.errors.base import (
    CarriesReason,
    WeightCacheError,
    error_classes,
    error_from_problem,
)
from protocol.errors.checkpoints import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    CorruptFileError,
    InvalidConfigError,
    InvalidScaleError,
    MissingTensorError,
    NotModelOptCheckpointError,
    NotRegularFileError,
    PathTooLongError,
    PermissionDeniedError,
    SymlinkRefusedError,
    TensorDtypeError,
    TensorParallelError,
    TensorShapeError,
    UnsupportedArchitectureError,
    UnsupportedQuantAlgoError,
)
from protocol.errors.engine import (
    ArenaUnavailableError,
    AttachError,
    BadResponseError,
    DaemonUnavailableError,
    HandleRefusedError,
    IpcOpenError,
    VerificationError,
)
from protocol.errors.leases import (
    DaemonRestartedError,
    LeaseExpiredError,
    LeaseNotFoundError,
    TooManyClientLeasesError,
    TooManyLeasesError,
    TooManyUserLeasesError,
)
from protocol.errors.models import (
    ArenaCorruptedError,
    ArenaLostError,
    ConflictError,
    CudaDriverError,
    InsufficientMemoryError,
    KeeperUnavailableError,
    LayoutMismatchError,
    ModelExistsError,
    ModelFailedError,
    ModelInUseError,
    ModelLoadingError,
    ModelNotFoundError,
    ShmDirError,
    TooManyLoadsError,
    TooManyModelsError,
)
from protocol.errors.parking import (
    NothingParkedError,
    ParkEndedError,
    ParkingNotFoundError,
    StartupSlotNotFoundError,
    TooManyClientParkedError,
    TooManyParkedError,
    TooManyUserParkedError,
)
from protocol.errors.requests import (
    HeadersTooLargeError,
    InvalidRequestError,
    MalformedRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PathNotAllowedError,
    PayloadTooLargeError,
    RequestTimeoutError,
    TooManyConnectionsError,
    UnauthorizedError,
)

__all__ = [
    "ArenaCorruptedError",
    "ArenaLostError",
    "ArenaUnavailableError",
    "AttachError",
    "BadResponseError",
    "CarriesReason",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointUnreadableError",
    "ClientNotVisibleError",
    "ClientNotYoursError",
    "ConflictError",
    "CorruptFileError",
    "CudaDriverError",
    "DaemonRestartedError",
    "DaemonUnavailableError",
    "ForbiddenError",
    "HandleRefusedError",
    "HeadersTooLargeError",
    "InsufficientMemoryError",
    "InvalidConfigError",
    "InvalidRequestError",
    "InvalidScaleError",
    "IpcOpenError",
    "KeeperUnavailableError",
    "LayoutMismatchError",
    "LeaseExpiredError",
    "LeaseNotFoundError",
    "LeaseNotYoursError",
    "MalformedRequestError",
    "MethodNotAllowedError",
    "MissingTensorError",
    "ModelExistsError",
    "ModelFailedError",
    "ModelInUseError",
    "ModelLoadingError",
    "ModelNotFoundError",
    "NotFoundError",
    "NotModelOptCheckpointError",
    "NotRegularFileError",
    "NothingParkedError",
    "ParkEndedError",
    "ParkingNotFoundError",
    "PathNotAllowedError",
    "PathTooLongError",
    "PayloadTooLargeError",
    "PeerNotAllowedError",
    "PermissionDeniedError",
    "RegistrationNotYoursError",
    "RequestTimeoutError",
    "ShmDirError",
    "StartupSlotNotFoundError",
    "SymlinkRefusedError",
    "TensorDtypeError",
    "TensorParallelError",
    "TensorShapeError",
    "TooManyClientLeasesError",
    "TooManyClientParkedError",
    "TooManyConnectionsError",
    "TooManyLeasesError",
    "TooManyLoadsError",
    "TooManyModelsError",
    "TooManyParkedError",
    "TooManyUserLeasesError",
    "TooManyUserParkedError",
    "UnauthorizedError",
    "UnsupportedArchitectureError",
    "UnsupportedQuantAlgoError",
    "VerificationError",
    "WeightCacheError",
    "error_classes",
    "error_from_problem",
]
