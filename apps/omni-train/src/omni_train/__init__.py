"""omni_train."""

__all__: list[str] = []
__version__ = "0.13.0"
