"""The runtime's one error class: a problem the user can fix, reported as one line by kimi-run."""


class RunError(Exception):
    pass
