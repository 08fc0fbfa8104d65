"""User-facing errors.

Anything raised as a `PetctlError` is printed by the CLI as a single line (no traceback) and turned into a
non-zero exit code, so bad input never produces a stack dump and scripts can rely on the exit status.
"""

from __future__ import annotations


class PetctlError(Exception):
    """An error the user can act on; its message is the whole story."""

    exit_code = 2


class NotSetUp(PetctlError):
    """`petctl setup` has not been run (or its state is gone)."""


class JobNotFound(PetctlError):
    exit_code = 3


class JobExists(PetctlError):
    pass


class ValidationError(PetctlError):
    pass


class ProviderError(PetctlError):
    """The backend (AWS, local processes) refused or failed an operation."""

    exit_code = 4


class ObjectStoreError(OSError):
    """The object store (`petctl.io.objstore`) could not be read or written; `code` is the backend's
    error code when it has one (an AWS error code on S3). Here, beside the user-facing errors, so that
    the AWS error translation (`petctl.io.aws`) can judge it without importing the store."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code
