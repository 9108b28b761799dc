"""Other shapes of a user's engine the suite accepts with ``--engine module:attr``.

Used by tests/test_cli.py: an engine class (``impl.LMHeadEngine`` subclassed by a user) and an
engine object that takes no settings.
"""

import impl


class MyEngine(impl.LMHeadEngine):
    """A user's LM engine class: built as ``MyEngine(**settings)``."""


class NoSettingsEngine(impl.LMHeadEngine):
    """An engine whose constructor takes no settings (no sequence parallelism, no bucket)."""

    def __init__(self):
        super().__init__()


ENGINE_OBJECT = NoSettingsEngine()


class NeedsAMissingModule(impl.LMHeadEngine):
    """An engine that needs a module this environment lacks (tests/test_fresh_env.py): built, it raises ImportError."""

    def __init__(self, **settings):
        raise ImportError("NeedsAMissingModule needs the module not_installed_here")
