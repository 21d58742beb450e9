"""The version of the distribution that installs both ``functional`` and ``distopt``.

Its one source: ``setup.cfg`` reads it (``version = attr: functional._version.__version__``,
evaluated without importing torch), and both packages' ``__version__`` import it. It lives
here because ``functional`` imports nothing from ``distopt``.
"""
__version__ = "0.1.0"
