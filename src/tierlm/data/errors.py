"""The one error type of the data package."""


class DataError(ValueError):
    """Bad training or eval input; the message names the file and what to change."""
