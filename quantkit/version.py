"""The package version, in a leaf module: checkpoints record it without importing the package's lazy API."""

__version__ = "0.1.0"
