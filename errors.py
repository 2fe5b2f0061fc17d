"""One error hierarchy: the CLI turns any MixqError into one stderr line and exit code 2."""


class MixqError(Exception):
    """Base class of every error mixq reports to a user."""


class InputError(MixqError):
    """A model, file or argument the user gave is missing, unreadable or malformed."""


class PlanError(MixqError):
    """A budget, override or plan that cannot be satisfied."""


class FormatError(MixqError):
    """A file on disk does not follow the format it claims (safetensors, EXL3, GGUF)."""
