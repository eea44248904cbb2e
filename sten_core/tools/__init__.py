"""Tools built on the public API: the ``sten`` command (``cli``), the demo,
``sten explain`` (``explain``), ``sten bench`` (``bench``) and ``sten.summary``.

Example:
    >>> from sten_core.tools.cli import main   # the ``sten`` console script
    >>> callable(main)
    True
"""
