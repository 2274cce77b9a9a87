"""Test-suite settings: hypothesis runs derandomized so every run checks the same examples."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "zephon",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("zephon")
