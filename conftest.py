pytest_plugins = ["paraxis.testing.pytest_plugin"]


def pytest_collection_finish(session):
    """Compile DeepSpeed's extensions once, in the pytest process, before any offload test
    runs (the DeepSpeed bridge's tests and tests/test_offload_*.py): a first build takes
    minutes on a busy machine, longer than the multi-rank harness waits for a rank (the
    harness's and pytest-timeout's limits do not apply to this hook). The build announces
    itself (paraxis_deepspeed.ops)."""
    from pathlib import Path

    def offload(item) -> bool:
        path = Path(str(item.fspath))
        return "deepspeed" in path.parts or path.name.startswith("test_offload_")

    if not any(offload(item) for item in session.items):
        return
    try:
        from paraxis_deepspeed.ops import build_ops
    except ImportError:
        return
    import deepspeed  # noqa: F401  (its accelerator is chosen on import)

    build_ops(lambda message: print(message, flush=True))
