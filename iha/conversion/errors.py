"""The errors of a conversion: one exception type that every command line prints as one line."""


class ConversionError(Exception):
    """A conversion that cannot go ahead: bad input, unsupported checkpoint, missing tensors, ..."""


class UnsupportedArchitectureError(ConversionError):
    pass


class VerificationFailedError(ConversionError):
    """The converted model does not compute what it should. Carries the report (a `ConversionReport`)."""

    def __init__(self, message: str, report):
        super().__init__(message)
        self.report = report
