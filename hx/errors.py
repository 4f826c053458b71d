"""The one error type users see."""


class HxError(Exception):
    """A problem with the user's input or environment, not a bug in hx.

    The message is one line that names the problem and what to do about it. The CLI prints it
    without a traceback and exits with status 2.
    """
