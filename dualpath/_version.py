"""The one place the package version lives (setup.py and the native build read it)."""

__version__ = "0.1.0"
