"""Errors of the converter; the CLI turns these into exit code 2 and one line."""

from armor_megatron.errors import UserInputError


class CheckpointError(UserInputError):
    """A checkpoint on disk is missing, incomplete or does not match the model description."""
