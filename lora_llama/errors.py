"""The one exception type for user mistakes.

The CLI turns a `UserError` into one line on stderr and exit code 2; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a wrong path, key, shape or value."""


class BadRecord(UserError):
    """A data record that cannot be read as its format says (a missing column, an unknown role, ...): a run skips
    and counts it, or with data.strict stops at it."""
