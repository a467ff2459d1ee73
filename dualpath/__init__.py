"""DualPath: a KV-cache data plane for PD-disaggregated agentic LLM inference.

Importing the package is cheap: the native extension (`dualpath._native`) is loaded only
by the modules that need verbs or the TCP provider.
"""

from dualpath._version import __version__

__all__ = ["__version__"]
