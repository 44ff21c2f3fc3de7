# The shared multi-rank harness: the session-scoped `worlds` fixture.
pytest_plugins = ["paraxis.testing.pytest_plugin"]
