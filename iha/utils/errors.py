"""The two ways a command fails, which its exit status tells apart (`iha.cli.running.exit_status`).

Input that cannot work (a bad flag value, a folder that does not exist, an unsupported checkpoint, rows of an unknown
schema) raises ValueError, or an error of its wing that says so (`ConversionError`): exit status 2, as argparse
gives for bad flags. Work that was started on good input and did not succeed raises `WorkFailedError`: exit status 1.
"""


class WorkFailedError(Exception):
    """The input was accepted and the work failed: a conversion that fails its verification, an upload the Hub
    refused, a server that could not start or listen. The message says what happened and what to do."""


__all__ = ["WorkFailedError"]
