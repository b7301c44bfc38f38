"""pytest conftest for vLLM's own tests/distributed/test_eplb_migration_scheduler.py, run unchanged
with eplb's migration schedule in vLLM's place (EPLB_VLLM_SCHEDULER=eplb) or without it (unset).

vLLM's general plugins are loaded as vLLM loads them in every process (load_general_plugins). With
EPLB_VLLM_SCHEDULER=eplb the eplb package's "vllm.general_plugins" entry point puts eplb's
schedule_migration_batches and schedule_migration_batches_for_layers in
vllm.distributed.eplb.migration_scheduler and in the modules that imported them from there
(rebalance_execute, async_worker); the test module, collected after this file, imports them from
migration_scheduler. Without it, vLLM keeps its own scheduler, and this file checks that nothing
changed.
"""

import os

from vllm.plugins import load_general_plugins

load_general_plugins()

from vllm.distributed.eplb import migration_scheduler as _scheduler  # noqa: E402
from vllm.distributed.eplb import rebalance_execute as _execute  # noqa: E402

_eplb_asked = os.environ.get("EPLB_VLLM_SCHEDULER", "").strip().lower() == "eplb"
_in_place = {
    "migration_scheduler.schedule_migration_batches": _scheduler.schedule_migration_batches,
    "migration_scheduler.schedule_migration_batches_for_layers":
        _scheduler.schedule_migration_batches_for_layers,
    "rebalance_execute.schedule_migration_batches": _execute.schedule_migration_batches,
}
for _name, _function in _in_place.items():
    if _function.__module__.startswith("eplb.") != _eplb_asked:
        raise RuntimeError(
            f"vllm.distributed.eplb.{_name} is {_function.__module__}.{_function.__name__}, "
            f"but EPLB_VLLM_SCHEDULER={os.environ.get('EPLB_VLLM_SCHEDULER')!r} asks for "
            f"{'eplb' if _eplb_asked else 'vLLM'}'s (VLLM_PLUGINS="
            f"{os.environ.get('VLLM_PLUGINS')!r})")


def pytest_report_header(config):
    return (f"eplb: vLLM's migration scheduler is "
            f"{_scheduler.schedule_migration_batches.__module__} "
            f"(EPLB_VLLM_SCHEDULER={os.environ.get('EPLB_VLLM_SCHEDULER')})")
