"""Counting the calls of one of the package's functions through the public commands (tests' helper)."""
import sys


def counted(monkeypatch, module, name):
    """Every call of ``module.name``, wherever the package holds that function, recorded in the returned list."""
    original, calls = getattr(module, name), []

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for held in [m for key, m in sys.modules.items() if key.startswith("polaformer")]:
        if getattr(held, name, None) is original:
            monkeypatch.setattr(held, name, counting)
    return calls
