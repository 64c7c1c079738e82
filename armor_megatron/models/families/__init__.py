"""The supported model families, one module each (see `models.family.Family`).

Importing this package imports every module in it, and each registers its family in
`models.arch.FAMILIES`: a new family is one new module here (plus its tiny model in the
converter's parity tests, ``tests/convert/conftest.py``); no other module names it.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
