"""The root of every error larql raises on purpose.

Anything that is a `LarqlError` carries a message meant for the user (what was wrong and what is
accepted); the CLI prints it without a traceback and exits 2, the server turns it into a 4xx.
"""


class LarqlError(Exception):
    """A typed, user-facing error."""


class InvalidInput(LarqlError):
    """A value given to a command or an API function that is out of range or inconsistent."""
