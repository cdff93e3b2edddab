"""What importing a part of msd_dask pulls in: torch only where a batch is built.

The scheduler imports :mod:`msd_dask.plugin.scheduler`, the Dask workers import the
roles (:mod:`msd_dask.roles.loader`, :mod:`msd_dask.roles.constructor`,
:mod:`msd_dask.roles.planner`) and the process that starts the service imports
:mod:`msd_dask.service`; none of them builds a torch tensor, and importing
torch costs each process about 100 MiB (see docs/benchmarks.md, Memory).
Each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _imported_after(code: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))\n"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return set(json.loads(res.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["msd_dask", "msd_dask.roles.loader", "msd_dask.plugin.scheduler",
                                    "msd_dask.roles.constructor", "msd_dask.roles.planner",
                                    "msd_dask.roles.supervisor", "msd_dask.service", "msd_dask.reader",
                                    "msd_dask.cli"])
def test_service_side_modules_do_not_import_torch(module: str) -> None:
    assert "torch" not in _imported_after(f"import {module}")


def test_public_names_do_not_import_torch() -> None:
    mods = _imported_after("from msd_dask import DataService, Batch, Config, Reader, load_config")
    assert "msd_dask" in mods and "torch" not in mods


def test_plugin_does_not_import_the_service() -> None:
    """The scheduler unpickling the plugin gets neither the roles nor their readers' libraries."""
    code = ("import msd_dask.plugin.scheduler, sys\n"
            "print(sorted(m for m in sys.modules if m.startswith('msd_dask')))\n")
    mods = _imported_after(code)
    assert not {"torch", "pyarrow", "PIL"} & mods
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "msd_dask.service" not in res.stdout and "msd_dask.roles.planner" not in res.stdout


def test_building_a_batch_imports_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from msd_dask import Batch\n"
        "assert 'torch' not in sys.modules\n"
        "ids = np.arange(8, dtype=np.int32).reshape(1, 8)\n"
        "b = Batch.from_payload({'step': 3, 'input_ids': ids, 'labels': ids, 'position_ids': ids,\n"
        "                        'cu_seqlens': [[0, 8]], 'documents': [[('s', 'f:0', 0)]],\n"
        "                        'cost': 8.0, 'epochs': [[0]]}, rank=1)\n"
        "import torch\n"
        "assert isinstance(b.input_ids, torch.Tensor) and b.input_ids.dtype == torch.long\n"
        "assert b.cu_seqlens[0].dtype == torch.int32 and b.num_tokens == 8\n"
    )
    assert "torch" in _imported_after(code)


def test_a_training_process_loads_no_file_format_or_image_library() -> None:
    """A reader unpickles the roles' actor handles (their modules get imported) but never
    reads files or decodes images: pyarrow and Pillow stay out of the training process."""
    mods = _imported_after("import msd_dask.service, msd_dask.roles.planner, msd_dask.roles.loader, "
                           "msd_dask.roles.constructor, msd_dask.roles.supervisor, msd_dask.torch")
    assert not {"pyarrow", "PIL"} & mods, sorted({"pyarrow", "PIL"} & mods)


def test_a_training_process_loads_no_planner_or_storage_module() -> None:
    """The modules a reader imports (its own, and those of the actor handles it unpickles:
    planner, constructors, loaders) leave the planner's and the loaders' machinery out:
    every module costs each training process memory (docs/benchmarks.md, Memory)."""
    code = ("import msd_dask.service, msd_dask.roles.planner, msd_dask.roles.loader, "
            "msd_dask.roles.constructor, msd_dask.torch, json, sys\n"
            "msd_dask.core.config.parse_config({'name': 'x', 'batch': {'seq_len': 8}, 'sources': "
            "[{'name': 's', 'uri': 'm://x', 'format': 'jsonl'}]})\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('msd_dask'))))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    heavy = {"msd_dask.core.plan", "msd_dask.core.stream", "msd_dask.roles.supervisor", "msd_dask.formats",
             "msd_dask.sources.storage", "msd_dask.sources.vision", "msd_dask.core.mixing",
             "msd_dask.core.balance"}
    assert not heavy & loaded, sorted(heavy & loaded)
    mods = _imported_after(code.splitlines()[0])
    assert not {"fsspec", "zstandard", "pyarrow", "PIL"} & mods, sorted(
        {"fsspec", "zstandard", "pyarrow", "PIL"} & mods)


#: what the ``msd-dask agent`` process imports: the command line, the service's handle, the
#: agent, and the roles whose actor handles its group readers unpickle
AGENT_IMPORTS = ("import msd_dask.cli, msd_dask.service.agent, msd_dask.roles.planner, "
                 "msd_dask.roles.constructor\nfrom msd_dask.service import DataService")


def test_the_host_agent_imports_only_dask_and_the_standard_library_beyond_msd_dask() -> None:
    """A host agent is python, the host's one Dask client and msd_dask's service side: no
    package beyond what ``import distributed`` loads (its floor) but the standard library
    (each agent's modules cost its host memory, docs/benchmarks.md, Memory)."""
    floor = _imported_after("import distributed")
    extra = _imported_after(AGENT_IMPORTS) - floor
    assert not extra - set(sys.stdlib_module_names) - {"msd_dask"}, sorted(extra)
    code = AGENT_IMPORTS + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    heavy = {"msd_dask.core.plan", "msd_dask.core.stream", "msd_dask.core.mixing",
             "msd_dask.core.balance", "msd_dask.core._kernels", "msd_dask.roles.loader",
             "msd_dask.roles.supervisor", "msd_dask.formats", "msd_dask.sources.storage",
             "msd_dask.sources.vision", "msd_dask.torch", "multiprocessing.shared_memory",
             "multiprocessing.resource_tracker"}
    assert not heavy & loaded, sorted(heavy & loaded)


def test_a_training_process_reading_through_an_agent_imports_no_dask() -> None:
    """A rank process behind a host agent (``MSD_DASK_AGENT``) imports msd_dask's service
    and torch side, but neither Dask nor the roles: it talks to the agent over a Unix
    socket, and what a direct reader needs is imported when a direct reader uses it."""
    code = ("import msd_dask.torch\nfrom msd_dask.service import DataService\n"
            "from msd_dask.service.agent_client import AgentHandle, read_block\n"
            "import json, sys\nprint(json.dumps(sorted(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    tops = {m.split(".")[0] for m in loaded}
    assert not {"distributed", "dask", "tornado", "pyarrow", "fsspec"} & tops, sorted(tops)
    unused = {m for m in loaded if m.startswith("msd_dask.roles.")} | (
        {"statistics", "multiprocessing.shared_memory"} & loaded)
    assert not unused, sorted(unused)


def test_the_config_names_every_balance_strategy() -> None:
    from msd_dask.core.balance import STRATEGIES
    from msd_dask.core.config import KNOWN_BALANCE

    assert sorted(KNOWN_BALANCE) == sorted(STRATEGIES)
