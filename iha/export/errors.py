class ExportError(ValueError):
    """A folder that cannot be exported as asked: the message says why and what would work."""
