"""Pickle payloads of crafted files: unpickling one creates a marker file (by running code)."""

import builtins
import os


class SystemPayload:
    """Unpickling it runs ``touch <marker>`` (a ``__reduce__`` to os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ExecPayload(SystemPayload):
    """Unpickling it creates ``<marker>`` through ``builtins.exec``."""

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))
