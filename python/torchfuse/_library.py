"""What the Python layer asks of the loaded library (torch.ops.torchfuse), answering as if
torchfuse were off where it is not loaded: the hooks never break the user's job."""
import json
import types

# Whether the rewritten Python code may call torchfuse's ops: torchfuse.disable() (and the
# `disabled()` context) turn it off, so the original code runs; the library's toggles switch
# the ops themselves.
rewrite_switch = types.SimpleNamespace(on=True)


def enabled_toggles(torch):
    """The toggles on in this process ({name: bool}), or {} when torchfuse is not loaded."""
    try:
        return json.loads(torch.ops.torchfuse.stats()).get("enabled", {})
    except Exception:
        return {}


def note(torch, message, debug=False):
    """One line in torchfuse's log (info, or debug), where the library is loaded."""
    try:
        torch.ops.torchfuse.note(message, debug)
    except Exception:
        pass
