"""omni_data."""

__all__: list[str] = []
__version__ = "0.1.0"
