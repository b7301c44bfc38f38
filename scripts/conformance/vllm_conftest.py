"""pytest conftest for vLLM's own tests/distributed/test_eplb_algo.py, run unchanged against eplb.

vLLM's general plugins are loaded as vLLM loads them in every process (load_general_plugins): the
eplb package's "vllm.general_plugins" entry point registers eplb's policy as vLLM's "default"
policy when EPLB_VLLM_POLICY asks for it. The test module imports DefaultEplbPolicy from
vllm.distributed.eplb.policy.default and calls it directly, so that name is pointed at the
registered policy before the module is collected: every call the tests make then reaches eplb.
"""

import os

from vllm.plugins import load_general_plugins

load_general_plugins()

from vllm.distributed.eplb import policy as _registry  # noqa: E402
from vllm.distributed.eplb.policy import default as _default  # noqa: E402

_policy = _registry.EPLB_POLICIES["default"]
if not _policy.__module__.startswith("eplb."):
    raise RuntimeError(
        f"vLLM's default EPLB policy is still {_policy.__module__}.{_policy.__name__}: eplb's "
        f"vllm.general_plugins entry point did not register it (EPLB_VLLM_POLICY="
        f"{os.environ.get('EPLB_VLLM_POLICY')!r}, VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r})")
_default.DefaultEplbPolicy = _policy


def pytest_report_header(config):
    return (f"eplb: vLLM's default EPLB policy is {_policy.__name__} "
            f"(EPLB_VLLM_POLICY={os.environ.get('EPLB_VLLM_POLICY')})")
