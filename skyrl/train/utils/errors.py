"""Errors shared across layers."""


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the key, the value and a fix."""
