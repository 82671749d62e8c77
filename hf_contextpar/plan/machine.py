"""What the cost model knows of a machine (`Machine`): attention and matmul FLOP/s, the ring's bandwidth and
latency, a GPU's occupancy, the planner's h coefficients; measured by `python -m hf_contextpar calibrate` into a
calibration file, read here, with defaults where nothing was measured. The cost model itself (costmodel.py) reads
no file."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from ..errors import ContextParallelError

PAPER_H = (-1.059, 1.145, 12.112)  # App. D's h(T,P) coefficients (a, b, c), fitted on Meta's H100 cluster
# Defaults when nothing was calibrated: a CPU core with gloo over loopback, a GPU with NVLink.
DEFAULTS = {"cpu": dict(attn_flops=2.0e10, bandwidth=1.0e9), "cuda": dict(attn_flops=3.0e14, bandwidth=1.0e11)}


def calibration_path() -> str:
    return os.environ.get(
        "HF_CONTEXTPAR_CALIBRATION",
        os.path.join(os.path.expanduser("~"), ".cache", "hf_contextpar", "calibration.json"),
    )


@dataclass
class Machine:
    """What the cost model knows of a machine; `python -m hf_contextpar calibrate` measures it."""

    attn_flops: float  # C_attn: achieved FLOP/s of the local attention kernel, per rank
    gemm_flops: float = float("inf")  # C_gemm: achieved FLOP/s of the linear layers, per rank
    bandwidth: float = float("inf")  # BW: ring send/recv bytes/s (N >= 2)
    latency: float = 0.0  # alpha: seconds of one small collective / message (N >= 2)
    memory_bandwidth: float = float("inf")  # bytes/s the device reads its memory at (decode is bound by it)
    # pass-Q's All2All where it runs at other rates than the ring's SendRecv (None: the ring's)
    all2all_bandwidth: float | None = None
    all2all_latency: float | None = None
    # The attention kernel's parallelism: `compute_units` blocks of `query_tile` query rows run at once
    # (a GPU's SMs and the kernel's tile), so a call with fewer rows x heads than that leaves units idle
    # and takes as long as one tile over its keys. 0: not modelled (CPU kernels split over keys too).
    compute_units: int = 0
    query_tile: int = 128
    source: str = "default"
    h_coefficients: tuple = PAPER_H  # App. D's empirical rule, for planner_rule="empirical"
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        rates = dict(attn_flops=self.attn_flops, gemm_flops=self.gemm_flops, bandwidth=self.bandwidth)
        rates["memory_bandwidth"] = self.memory_bandwidth
        if self.all2all_bandwidth is not None:
            rates["all2all_bandwidth"] = self.all2all_bandwidth
        if not all(v > 0 for v in rates.values()):  # a division by zero (or a negative time) later
            raise ContextParallelError(
                f"a calibration's rates must be positive, got {rates}; measure them again with "
                "`python -m hf_contextpar calibrate`."
            )

    @property
    def a2a_bandwidth(self) -> float:
        return self.bandwidth if self.all2all_bandwidth is None else self.all2all_bandwidth

    @property
    def a2a_latency(self) -> float:
        return self.latency if self.all2all_latency is None else self.all2all_latency

    def occupancy(self, queries: float, heads: int) -> float:
        """How many times longer than its FLOPs at C_attn an attention call of `queries` rows of each of
        `heads` heads takes: the kernel runs heads x ceil(queries / query_tile) tiles in waves of
        compute_units, each tile streaming every key, so the call takes waves x one tile's time (one
        wave below compute_units tiles, however few the queries). Measured on an H200 (132 SMs, cuDNN
        attention, 16 heads over 32,000 keys): 64 to 800 queries 371 us, 1,056 and 1,600 761 us
        (2 waves), 3,200 1,515 us (4 waves)."""
        if not self.compute_units or queries <= 0:
            return 1.0
        waves = math.ceil(heads * math.ceil(queries / self.query_tile) / self.compute_units)
        return max(1.0, waves * self.compute_units * self.query_tile / (heads * queries))

    def as_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | None = None) -> str:
        path = path or calibration_path()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
        return path

    @classmethod
    def load(cls, path: str) -> Machine:
        with open(path) as f:
            data = json.load(f)
        data["h_coefficients"] = tuple(data.get("h_coefficients", PAPER_H))
        return cls(**data)

    @classmethod
    def resolve(cls, calibration=None, device_type: str = "cpu") -> Machine:
        """An explicit Machine / dict / path, else the saved file, else the defaults."""
        if isinstance(calibration, Machine):
            return calibration
        if isinstance(calibration, dict):
            return cls(**calibration)
        path = calibration or calibration_path()
        if os.path.exists(path):
            return cls.load(path)
        if calibration:
            raise FileNotFoundError(f"calibration file {path} does not exist; run `python -m hf_contextpar calibrate`.")
        return cls(**DEFAULTS.get(device_type, DEFAULTS["cpu"]), source="default")
