"""attnkit's version, in one place (the package and the measurements that name their build read it)."""

__version__ = "0.1.0"
