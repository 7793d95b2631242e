"""flash-linear-attention's package without its fla/__init__.py, which imports its layers and models (and
transformers with them): only fla.ops is needed for the anchors. Shared by the anchor scripts."""
import importlib.util
import os
import re
import sys
import types


def import_fla_package():
    """Registers a bare `fla` package (with __version__) so that `fla.ops...` imports work; returns it."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flash-linear-attention not on PYTHONPATH")
    pkg = types.ModuleType("fla")
    pkg.__path__ = list(spec.submodule_search_locations)
    with open(os.path.join(pkg.__path__[0], "__init__.py")) as f:
        pkg.__version__ = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)
    sys.modules["fla"] = pkg
    return pkg
