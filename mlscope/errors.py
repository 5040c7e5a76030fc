"""The one exception tree of mlscope.

    MLScopeError
    ├── ConfigError(ValueError)            bad settings or arguments
    ├── ManifestError(ValueError)          a manifest file is invalid (file, line, field)
    ├── ArtifactError                      an asset is missing, unreachable or corrupt
    │   └── ChecksumMismatch
    ├── WireError(ValueError)              a bus message could not be decoded / validated
    ├── BusError                           NATS is unreachable or a request timed out
    │   ├── BusNotFound(LookupError)       a key, bucket, object or stream is not there
    │   └── BusRefused                     the server refused a message (too large,
    │       │                              a JetStream API error): retrying will not help
    │       └── BusDenied                  the client's credentials do not allow it
    ├── ResolutionError(LookupError)       no live agent matches a job
    ├── UnknownModelError(LookupError)     the model is not in any manifest
    ├── PredictorError                     a framework failed (typed fields below)
    │   ├── FrameworkUnavailable(ImportError)
    │   ├── ModelLoadError
    │   ├── InputMismatchError(ValueError)
    │   └── InferenceError
    ├── EvaluationError                    an evaluation could not complete
    │   └── OverloadedError                an agent's queue was full: the query was refused
    ├── DatabaseError                      the evaluation database rejected a request
    │   ├── QueryRefused                   a client's SQL is not one bounded read
    │   ├── CursorNotFound(LookupError)    no paged result of that id on this server
    │   └── EvaluationNotFound(LookupError)  no evaluation of that id is stored (yet)
    └── ServiceError                       a handler failed unexpectedly (any other
                                           exception, translated by mlscope.serving)

Third-party exceptions are translated once, at the adapter that calls the library
(NATS's in :mod:`mlscope.bus`: ``bus_errors`` and the helpers beside it).
Every error has a stable ``code`` so that it survives the trip over the bus.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "ArtifactError",
    "BusDenied",
    "BusError",
    "BusNotFound",
    "BusRefused",
    "ChecksumMismatch",
    "ConfigError",
    "CursorNotFound",
    "DatabaseError",
    "EvaluationError",
    "EvaluationNotFound",
    "FrameworkUnavailable",
    "InferenceError",
    "InputMismatchError",
    "MLScopeError",
    "ManifestError",
    "ModelLoadError",
    "OverloadedError",
    "PredictorError",
    "QueryRefused",
    "ReplyTooLarge",
    "ResolutionError",
    "ServiceError",
    "UnknownModelError",
    "WireError",
    "error_from_wire",
]


class MLScopeError(Exception):
    """Root of every error mlscope raises on purpose."""

    code: ClassVar[str] = "error"

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def to_wire(self) -> dict[str, Any]:
        """A plain mapping for an error reply on the bus."""
        return {"code": self.code, "message": self.message, "fields": _plain(self.fields)}


class ConfigError(MLScopeError, ValueError):
    code = "config"


class ManifestError(MLScopeError, ValueError):
    """A manifest failed validation; ``file``, ``line`` and ``field`` say where;
    ``reason``, where given, why an agent refuses to serve it (a
    :data:`~mlscope.contracts.RefusalReason`)."""

    code = "manifest"

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        field: str | None = None,
        line: int | None = None,
        reason: str | None = None,
    ) -> None:
        where = ":".join(str(p) for p in (file, line) if p is not None)
        prefix = f"{where}: " if where else ""
        at = f"field '{field}': " if field else ""
        extra = {"reason": reason} if reason is not None else {}
        super().__init__(f"{prefix}{at}{message}", file=file, field=field, line=line, **extra)
        self.file, self.field, self.line = file, field, line


class ArtifactError(MLScopeError):
    code = "artifact"


class ChecksumMismatch(ArtifactError):
    code = "checksum"


class WireError(MLScopeError, ValueError):
    code = "wire"


class BusError(MLScopeError):
    code = "bus"


class BusNotFound(BusError, LookupError):
    code = "bus_not_found"


class BusRefused(BusError):
    code = "bus_refused"


class BusDenied(BusRefused):
    """The NATS server denied this client a subject (a permissions violation): it drops
    what was published there, which would otherwise look like a timeout."""

    code = "bus_denied"


class ResolutionError(MLScopeError, LookupError):
    code = "resolution"


class UnknownModelError(MLScopeError, LookupError):
    code = "unknown_model"


class PredictorError(MLScopeError):
    """A framework failed; ``model``, ``framework`` and details are in ``fields``."""

    code = "predictor"


class FrameworkUnavailable(PredictorError, ImportError):
    code = "framework_unavailable"


class ModelLoadError(PredictorError):
    code = "model_load"


class InputMismatchError(PredictorError, ValueError):
    code = "input_mismatch"


class InferenceError(PredictorError):
    code = "inference"


class EvaluationError(MLScopeError):
    code = "evaluation"


class OverloadedError(EvaluationError):
    """The agent refused a query without running it (its queue was full): counted as
    *refused*, apart from failures (:mod:`mlscope.outcomes`)."""

    code = "overloaded"


class DatabaseError(MLScopeError):
    code = "database"


class ServiceError(MLScopeError):
    """A handler raised something that is not an MLScopeError; ``service`` and
    ``exception`` (the type name) say where and what."""

    code = "service"


class QueryRefused(DatabaseError):
    """A client's SQL was refused: not one read-only SELECT, a forbidden function, or
    it went past a read limit (time, rows, bytes, memory)."""

    code = "query_refused"


class CursorNotFound(DatabaseError, LookupError):
    """A page was asked of a result that the server does not hold: never opened there,
    read to its end, expired after sitting idle, or another request is reading it.
    The statement must be run again."""

    code = "cursor_not_found"


class EvaluationNotFound(DatabaseError, LookupError):
    """No evaluation of that id is stored: never run, or still running (a submitter
    asks while it waits)."""

    code = "evaluation_not_found"


class ReplyTooLarge(MLScopeError):
    """An answer would not fit one message of the bus (the server's max payload): the
    request must ask for less (fewer rows, a page at a time)."""

    code = "reply_too_large"


_BY_CODE: dict[str, type[MLScopeError]] = {}


def _register(cls: type[MLScopeError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(MLScopeError)


def error_from_wire(payload: dict[str, Any]) -> MLScopeError:
    """Rebuild a typed error from an error reply (unknown codes become the root type)."""
    cls = _BY_CODE.get(str(payload.get("code")), MLScopeError)
    err = MLScopeError.__new__(cls)
    MLScopeError.__init__(err, str(payload.get("message", "")), **dict(payload.get("fields") or {}))
    return err


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
