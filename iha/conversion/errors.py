"""The errors of a conversion: one exception type that every command line prints as one line.

Bad input raises `ConversionError` (exit status 2); a conversion that ran and does not compute what it should raises
`VerificationFailedError`, which is also a `WorkFailedError` (exit status 1, `iha.cli.running`).
"""

from ..utils.errors import WorkFailedError


class ConversionError(Exception):
    """A conversion that cannot go ahead: bad input, unsupported checkpoint, missing tensors, ..."""


class UnsupportedArchitectureError(ConversionError):
    pass


class VerificationFailedError(ConversionError, WorkFailedError):
    """The converted model does not compute what it should. Carries the report (a `ConversionReport`)."""

    def __init__(self, message: str, report):
        super().__init__(message)
        self.report = report
