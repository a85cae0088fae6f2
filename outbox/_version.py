"""The package's version, written here only: ``pyproject.toml`` reads it
(``[tool.setuptools.dynamic]``), ``outbox.__version__`` and ``outbox --version`` show it.
A plain assignment, so that setuptools reads it without importing the package."""

__version__ = "0.7.0"
