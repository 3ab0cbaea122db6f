"""The package's version, in the bottom layer so that any module may report it (the server's /version)."""

__version__ = "0.1.0"  # pyproject.toml's [project] version
