"""The one exception type the CLIs turn into a one-line message and a nonzero exit."""


class GlmkitError(Exception):
    """A user-facing error: the message names the file, tensor or argument at fault."""
