"""The user-error base class: faults the user can fix (config, input, run directory, disk), shown as one paragraph."""
from __future__ import annotations


class UserError(Exception):
    """A fault the user can fix. The CLI and the jobs print its message (what was wrong, what was
    found, what to do) as one paragraph and exit 2, also when it was raised inside a Ray task or actor."""
