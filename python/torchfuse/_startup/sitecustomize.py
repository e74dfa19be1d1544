"""torchfuse's Python start-up hook (this folder is put on PYTHONPATH by the launcher, `torchfuse
COMMAND` or scripts/torchfuse): installs the package's hooks, which import nothing until the
modules they patch are imported (torchfuse/_hooks.py). Where the command's Python cannot import
the `torchfuse` package from its own paths, the package's folder is added after them, not ahead
of its standard library (in an installed wheel that folder is a whole site-packages).

Python runs one `sitecustomize`; the one this shadows (if any) is run after this one.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HOOK_DIR = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize():
    for entry in sys.path:
        if os.path.abspath(entry or os.getcwd()) == _HOOK_DIR:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


try:
    if importlib.util.find_spec("torchfuse") is None:
        sys.path.append(os.path.dirname(os.path.dirname(_HOOK_DIR)))
    import torchfuse

    torchfuse.install_hooks()
except Exception as e:
    print(f"torchfuse: hooks not installed ({e!r})", file=sys.stderr)
_run_shadowed_sitecustomize()
