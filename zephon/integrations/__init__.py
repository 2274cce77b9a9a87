"""Optional integrations with training frameworks.

Each lives in its own module and imports its framework only when that module is imported, so
``import zephon`` never imports them: ``zephon.integrations.torch`` (PyTorch / torchdata).
"""
