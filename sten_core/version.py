"""The version of sten-core (the distribution's, kept in step with pyproject.toml).

Example:
    >>> from sten_core.version import __version__
    >>> __version__.count(".")
    2
"""

__version__ = "0.1.0"
