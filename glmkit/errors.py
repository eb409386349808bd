"""The exception type the CLIs turn into a one-line message and a nonzero exit, and its kinds a caller may act on."""


class GlmkitError(Exception):
    """A user-facing error: the message names the file, tensor or argument at fault."""


class DeviceMemoryError(GlmkitError):
    """A device's memory cannot hold what a forward needs (e.g. the KV rows of a batch's sequences on a discrete
    GPU); fewer rows at once may fit."""
