"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class MoeLitError(Exception):
    """Bad input from the user (config, paths, data, task names). Never a bug in moe_lit."""
