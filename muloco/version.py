"""The package's version, in a module of its own so that what records it (summary.json, an export's
config) imports it without the package's top (muloco/__init__.py)."""

__version__ = "0.1.0"
