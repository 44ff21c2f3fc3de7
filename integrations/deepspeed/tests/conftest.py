"""Compile DeepSpeed's extensions once, in the pytest process, before any test of this
package runs: a first build takes minutes on a busy machine, longer than the
multi-rank harness waits for a rank (the harness's and pytest-timeout's limits do not
apply to this hook). The build announces itself (paraxis_deepspeed.ops)."""

from pathlib import Path

HERE = Path(__file__).parent


def pytest_collection_finish(session):
    if not any(Path(str(item.fspath)).parent == HERE for item in session.items):
        return
    try:
        from paraxis_deepspeed.ops import build_ops
    except ImportError:
        return
    import deepspeed  # noqa: F401  (its accelerator is chosen on import)

    build_ops(lambda message: print(message, flush=True))
