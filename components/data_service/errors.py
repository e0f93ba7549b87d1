"""The one exception type of the dataset layer: a message a user can act on (file, column, row)."""


class DataError(Exception):
    """Bad input or a bad dataset directory. The CLI prints it as one line and exits non-zero."""
