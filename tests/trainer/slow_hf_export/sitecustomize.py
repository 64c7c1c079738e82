"""Start-up hook of the processes of a test that kills ``armor-train`` during its HF export.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry holding one; a test
puts this folder first on ``PYTHONPATH``. When ``armor_megatron.trainer.hf_save`` is imported, its
export stalls (for ``ARMOR_TEST_EXPORT_STALL_S`` seconds) right after the staging directory is
complete and before it is renamed into place: the widest window of a real export, held open long
enough for the test to see it and ``kill -9`` the run inside it.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

TARGET = "armor_megatron.trainer.hf_save"


class _StallExport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            replace_dir = module._replace_dir

            def stalled_replace_dir(tmp, final):
                if os.path.basename(tmp).startswith(".step_"):  # an export's staging (not hf_config's)
                    time.sleep(float(os.environ.get("ARMOR_TEST_EXPORT_STALL_S", "600")))
                replace_dir(tmp, final)

            module._replace_dir = stalled_replace_dir

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _StallExport())
