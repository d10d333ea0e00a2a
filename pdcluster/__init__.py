"""pdcluster: one namespace for the serving cluster and the offline engine.

    import pdcluster

    with pdcluster.launch(pdcluster.ClusterConfig(model="preset:tiny-llama", mixed={"count": 1})) as c:
        print(c.generate("Hello", pdcluster.SamplingParams(max_tokens=8))[0].text)

The names resolve on first use, so `import pdcluster` (and `pdcluster --version`) loads
neither torch nor Ray.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("pdcluster")
except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
    __version__ = "0+unknown"

# Installed, the subpackages (pdcluster.engine, pdcluster.cluster, ...) sit inside this folder.
# In a source checkout that is not installed (`ray job submit --working-dir .`) they are the
# repository's top-level folders beside it.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "engine")) and os.path.isfile(
    os.path.join(_CHECKOUT, "engine", "__init__.py")
):
    __path__.append(_CHECKOUT)

# public name -> module that defines it
_EXPORTS = {
    "Cluster": "pdcluster.cluster.client",
    "ClusterConfig": "pdcluster.cluster.config",
    "LLM": "engine",
    "SamplingParams": "engine",
    "launch": "pdcluster.cluster.control.launch",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdcluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolved once
    return value
