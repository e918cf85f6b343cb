"""The error type of the data package."""

from __future__ import annotations


class DataError(ValueError):
    """Bad prompt data or data config; the message names the file, the row and the fix."""
