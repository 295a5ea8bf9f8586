"""The typed failures of an engine step (and of the FFN backends it calls): each says whether a
caller may go on (`recoverable`) and carries the detail a user needs."""

from __future__ import annotations

from larql.errors import LarqlError


class EngineError(LarqlError):
    """Base of the five engine failures; `recoverable` says whether a caller may go on."""

    recoverable: bool = False


class EmptyPrompt(EngineError):
    recoverable = True

    def __init__(self) -> None:
        super().__init__("engine called with empty prompt")


class BackendUnavailable(EngineError):
    recoverable = True

    def __init__(self, detail: str = "") -> None:
        # A bare message; with a detail (a missing capability, an unreachable FFN
        # shard) the detail says what is unavailable.
        message = (
            f"backend unavailable: {detail}"
            if detail
            else ("backend does not support this operation")
        )
        super().__init__(message)
        self.detail = detail


class RetrievalMiss(EngineError):
    recoverable = True

    def __init__(self, reason: str) -> None:
        super().__init__(f"retrieval miss: {reason}")
        self.reason = reason


class InvariantViolation(EngineError):
    def __init__(self, what: str) -> None:
        super().__init__(f"engine invariant violated: {what}")
        self.what = what


class BackendFailure(EngineError):
    def __init__(self, details: str) -> None:
        super().__init__(f"backend operation failed: {details}")
        self.details = details
