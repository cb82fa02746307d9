"""The error a bad flag, flag combination or input raises before any model is loaded. A leaf: it imports nothing of
ours, so any module (``runtime/``, ``checks/``, ``config/``) can raise it without an import arrow into the others."""


class ConfigError(ValueError):
    """A bad flag or flag combination, found before any model is loaded."""
