"""A fake of the NVML hardware: the pynvml functions ``sglang_sm120.machine.host_checks``
calls, answering from
a host fixture's ``nvml.json`` (``test/fixtures/hosts/<case>/``, written by its ``build.py``).

``missing``: functions this nvidia-ml-py "lacks" (an older release); ``failing``: functions that
raise NVMLError, as a driver in a bad state does.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hosts"


class NVMLError(Exception):
    pass


class FakeNvml:
    NVMLError = NVMLError
    NVML_P2P_CAPS_INDEX_READ = 0
    NVML_P2P_CAPS_INDEX_WRITE = 1
    NVML_P2P_STATUS_OK = 0
    NVML_FEATURE_ENABLED = 1

    def __init__(
        self, spec: dict[str, Any], missing: tuple[str, ...] = (), failing: tuple[str, ...] = ()
    ) -> None:
        self._gpus = spec["gpus"]
        self._topology = spec.get("topology", [])
        self._p2p_status = spec.get("p2p_status", 0)
        self._missing = set(missing)
        self._failing = set(failing)
        self.initialised = 0

    @classmethod
    def of(cls, case: str, **kwargs: Any) -> FakeNvml:
        return cls(json.loads((FIXTURES / case / "nvml.json").read_text()), **kwargs)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            if name in object.__getattribute__(self, "_missing"):
                raise AttributeError(name)
            if name in object.__getattribute__(self, "_failing"):

                def fail(*args: Any) -> Any:
                    raise NVMLError(f"Unknown Error ({name})")

                return fail
        return object.__getattribute__(self, name)

    def _gpu(self, handle: int) -> dict[str, Any]:
        return self._gpus[handle]

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return SimpleNamespace(busId=self._gpu(handle)["bus_id"].encode())

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-fake-{handle}"

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return tuple(self._gpu(handle).get("capability", (12, 0)))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle)["gen"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle)["max_gen"]

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: int) -> int:
        return self._gpu(handle)["gpu_max_gen"]

    def nvmlDeviceGetPerformanceState(self, handle: int) -> int:
        return self._gpu(handle).get("pstate", 8)  # P8: idle

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return self._gpu(handle)["width"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return self._gpu(handle)["max_width"]

    def nvmlDeviceGetBAR1MemoryInfo(self, handle: int) -> Any:
        total = self._gpu(handle)["bar1_total"]
        return SimpleNamespace(bar1Total=total, bar1Used=0, bar1Free=total)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self._topology[a][b]

    def nvmlDeviceGetPersistenceMode(self, handle: int) -> int:
        return self._gpu(handle)["persistence"]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        return self._p2p_status
