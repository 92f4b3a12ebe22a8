"""The goodput model's parameters: :class:`ClusterParams` (the cluster, its failure rate and the
costs of both recovery schemes), each default with its source, published, derived from published
figures or assumed (:data:`REFERENCES`), calibrated so that checkpoint-restart keeps what the Llama 3
report says it kept (:data:`LLAMA3_EFFECTIVE_TRAINING_TIME`). The model that reads them is
:mod:`checkpointless.analysis.goodput_model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

__all__ = [
    "INTEGER_FIELDS",
    "LLAMA3_EFFECTIVE_TRAINING_TIME",
    "LLAMA3_FAILURES_PER_GPU_HOUR",
    "REFERENCES",
    "ClusterParams",
]

#: Llama 3 report (section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_FAILURES_PER_GPU_HOUR: float = 419.0 / (54.0 * 24.0 * 16384.0)
#: Llama 3 report (section 3.3.4): "higher than 90% effective training time" (useful training time
#: over elapsed time) on 16,384 GPUs, with checkpoint-restart; the calibration target of the defaults.
LLAMA3_EFFECTIVE_TRAINING_TIME: float = 0.90

#: The published sources of the defaults, cited by ``checkpointless simulate --help`` and the
#: benchmarks page.
REFERENCES: tuple[str, ...] = (
    '[Llama 3] A. Dubey et al. (Meta), "The Llama 3 Herd of Models", arXiv:2407.21783, 2024: '
    "section 3.3.4 (466 job interruptions in a 54-day snapshot on 16,384 H100 GPUs, 47 planned, "
    "419 unexpected, 78% of those hardware-related; >90% effective training time), section 3.3.1 "
    "(Tectonic storage: 2 TB/s sustained, 7 TB/s peak; checkpoints of 1 MB to 4 GB model state per "
    "GPU; 400 Gb/s interconnect per GPU), Table 4 (16,384 GPUs: 16M tokens per batch, ~400 TFLOP/s "
    "per GPU)",
    "[NCCL #1156] a PyTorch distributed maintainer in https://github.com/NVIDIA/nccl/issues/1156 "
    "(2024): ~2.5 min of NCCL initialisation on the default path above a few thousand GPUs, at launch "
    "and again at every restart after a GPU failure",
    '[Daly 2006] J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart '
    'dumps", Future Generation Computer Systems 22(3), 2006 (the checkpoint-restart model)',
)

_PUB, _DER, _ASM = "published", "derived from published figures", "assumption"

# Fields that must be > 0 (all other float fields must be >= 0).
_POSITIVE_FIELDS = frozenset(
    {"failures_per_accel_hour", "step_time_s", "checkpoint_cost_s", "peer_bandwidth_gb_s"}
)
#: The :class:`ClusterParams` fields that are integers, each with its minimum (``__post_init__``
#: refuses a bool, a float or a smaller value); every other field is a float.
INTEGER_FIELDS: dict[str, int] = {"n_accelerators": 1, "spare_pool_size": 0}


@dataclass(kw_only=True)
class ClusterParams:
    """Cluster, failure and cost parameters; defaults calibrated to published figures.

    Each field's metadata carries ``help`` and ``source`` (``published``, ``derived from published
    figures`` or ``assumption``, with the figure or reasoning); ``checkpointless simulate --help`` and
    the benchmarks page print them. Sources in :data:`REFERENCES`. With these defaults
    checkpoint-restart keeps ~0.91 of wall time at 16,384 GPUs (Llama 3: >90%).

    Attributes:
        n_accelerators: accelerators (= ranks) in the job. Default 16,384, the Llama 3 405B
            pre-training cluster that the failure rate comes from.
        failures_per_accel_hour: failure rate per accelerator-hour (Llama 3: 419 / (54 d * 24 h *
            16,384 GPUs) ~= 1.97e-5).
        step_time_s: seconds per optimizer step (6 s: Llama 3 405B, 6 * 405e9 * 16M tokens at
            ~400 TFLOP/s on each of 16,384 GPUs).
        checkpoint_cost_s: time training is blocked per checkpoint write (``C``). 20 s (assumption,
            >= 3.3 s for ~6.5 TB at Llama 3's 2 TB/s sustained storage throughput).
        checkpoint_load_s: time to read the checkpoint back on restart. 60 s (assumption).
        restart_base_s: fixed part of a job restart: detect the failure, tear down, re-schedule on
            a standby node, start containers, import, initialise CUDA. 120 s (assumption).
        restart_per_log2_rank_s: restart time per doubling of ranks (tree-structured bootstrap,
            NCCL communicator init). 8 s (112 s at 16k; assumption).
        restart_per_rank_s: restart time linear in ranks (a central rendezvous store every rank
            connects to, address all-gather). 2 ms (33 s at 16k, 200 s at 100k; assumption). With
            the log term, ~145 s at 16k, near the ~2.5 min NCCL initialisation at restart reported
            above a few thousand GPUs (NCCL #1156).
        detect_base_s: checkpointless failure detection, fixed part (heartbeat timeout). 10 s.
        detect_per_log2_rank_s: detection per doubling of ranks (propagating the failure notice
            down a tree). 0.5 s.
        reform_base_s: in-process process-group re-formation, fixed part (abort the old
            communicator, agree on the new membership). 5 s.
        reform_per_log2_rank_s: re-formation per doubling of ranks (communicator bootstrap). 1 s.
        reform_per_rank_s: re-formation linear in ranks (membership broadcast through a store that
            is already up, so much cheaper than a cold rendezvous). 0.5 ms.
        shard_state_gb: per-rank state copied to the replacement, in GB; does not grow with ``N``.
            4 GB: the largest per-GPU model state Llama 3 checkpoints (1 MB to 4 GB per GPU).
        peer_bandwidth_gb_s: peer-to-peer bandwidth for that transfer, GB/s. 25 GB/s: half of the
            400 Gb/s per-GPU interconnect of the Llama 3 cluster.
        spare_pool_size: hot spares standing by (``S``). 16 (assumption).
        spare_replace_s: time until a consumed spare is replaced in the pool (``D``): drain,
            swap or repair, re-image, health-check. 4 h (assumption).
        checkpointless_overhead: steady-state fraction of step time lost to the fault-tolerance
            machinery (heartbeats, keeping peer replicas current). 0.01 (assumption).
    """

    n_accelerators: int = field(
        default=16_384,
        metadata={"help": "accelerators (ranks) in the job", "source": f"{_PUB}: Llama 3 cluster size"},
    )
    failures_per_accel_hour: float = field(
        default=LLAMA3_FAILURES_PER_GPU_HOUR,
        metadata={
            "help": "failures per accelerator-hour",
            "source": f"{_PUB}: Llama 3 section 3.3.4, 419 unexpected interruptions / "
            "(54 days * 24 h * 16,384 GPUs)",
        },
    )
    step_time_s: float = field(
        default=6.0,
        metadata={
            "help": "seconds per training step",
            "source": f"{_DER}: Llama 3 Table 4, 6 * 405e9 params * 16M tokens / (16,384 GPUs * "
            "400 TFLOP/s) = 5.9 s",
        },
    )
    checkpoint_cost_s: float = field(
        default=20.0,
        metadata={
            "help": "blocking checkpoint write, s",
            "source": f"{_ASM}: ~6.5 TB of state (405e9 params * 16 B) at the 2 TB/s sustained storage "
            "throughput of Llama 3 section 3.3.1 is >= 3.3 s; 20 s allows for the bursty checkpoint "
            "writes saturating the storage fabric that it reports, and the synchronisation around them",
        },
    )
    checkpoint_load_s: float = field(
        default=60.0,
        metadata={
            "help": "checkpoint load on restart, s",
            "source": f"{_ASM}: >= 3.3 s for 6.5 TB at 2 TB/s (Llama 3 section 3.3.1); 60 s for every "
            "rank reading at once, metadata and placement",
        },
    )
    restart_base_s: float = field(
        default=120.0,
        metadata={
            "help": "fixed job-restart cost, s",
            "source": f"{_ASM}: detect, tear down, re-schedule on a standby node, start containers, "
            "import, initialise CUDA (Llama 3 reports having reduced job start-up time, without a figure)",
        },
    )
    restart_per_log2_rank_s: float = field(
        default=8.0,
        metadata={
            "help": "job-restart cost per log2(ranks), s",
            "source": f"{_ASM}: with the per-rank term ~145 s of bootstrap and communicator init at "
            "16,384 ranks, near the ~2.5 min NCCL init at restart reported above a few thousand GPUs "
            "(NCCL #1156)",
        },
    )
    restart_per_rank_s: float = field(
        default=0.002,
        metadata={
            "help": "job-restart cost per rank, s",
            "source": f"{_ASM}: a central rendezvous every rank connects to, 2 ms each (33 s at 16,384)",
        },
    )
    detect_base_s: float = field(
        default=10.0,
        metadata={"help": "checkpointless detection, fixed, s", "source": f"{_ASM}: heartbeat timeout"},
    )
    detect_per_log2_rank_s: float = field(
        default=0.5,
        metadata={
            "help": "checkpointless detection per log2(ranks), s",
            "source": f"{_ASM}: failure notice down a tree",
        },
    )
    reform_base_s: float = field(
        default=5.0,
        metadata={
            "help": "process-group re-formation, fixed, s",
            "source": f"{_ASM}: abort the old communicator, agree on the membership",
        },
    )
    reform_per_log2_rank_s: float = field(
        default=1.0,
        metadata={
            "help": "process-group re-formation per log2(ranks), s",
            "source": f"{_ASM}: communicator bootstrap",
        },
    )
    reform_per_rank_s: float = field(
        default=0.0005,
        metadata={
            "help": "process-group re-formation per rank, s",
            "source": f"{_ASM}: membership through a store that is already up",
        },
    )
    shard_state_gb: float = field(
        default=4.0,
        metadata={
            "help": "per-rank state to transfer, GB",
            "source": f"{_PUB}: the largest per-GPU model state Llama 3 checkpoints (1 MB to 4 GB, "
            "section 3.3.1); a peer holding a replica of it is the checkpointless premise",
        },
    )
    peer_bandwidth_gb_s: float = field(
        default=25.0,
        metadata={
            "help": "peer transfer bandwidth, GB/s",
            "source": f"{_ASM}: half of the 400 Gb/s per-GPU interconnect of Llama 3 section 3.3.1",
        },
    )
    spare_pool_size: int = field(
        default=16, metadata={"help": "hot spares in the pool", "source": f"{_ASM}: two 8-GPU nodes"}
    )
    spare_replace_s: float = field(
        default=4 * 3600.0,
        metadata={
            "help": "time to replace a consumed spare, s",
            "source": f"{_ASM}: drain, swap or repair, re-image, health-check",
        },
    )
    checkpointless_overhead: float = field(
        default=0.01,
        metadata={
            "help": "steady-state overhead fraction of checkpointless, [0, 1)",
            "source": f"{_ASM}: heartbeats and keeping peer replicas current",
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            name = f.name
            value = getattr(self, name)
            if name in INTEGER_FIELDS:
                lo = INTEGER_FIELDS[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                    raise ValueError(f"ClusterParams.{name} must be an integer >= {lo}, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"ClusterParams.{name} must be a finite number, got {value!r}")
            if name in _POSITIVE_FIELDS and value <= 0:
                raise ValueError(f"ClusterParams.{name} must be > 0, got {value!r}")
            if value < 0:
                raise ValueError(f"ClusterParams.{name} must be >= 0, got {value!r}")
        if self.checkpointless_overhead >= 1:
            raise ValueError(
                f"ClusterParams.checkpointless_overhead must be < 1, got {self.checkpointless_overhead!r}"
            )

    # ------------------------------------------------------------------ derived quantities

    @property
    def failure_rate_per_s(self) -> float:
        """Job-level failure rate ``lam = N * r`` in failures per second."""
        return self.n_accelerators * self.failures_per_accel_hour / 3600.0

    @property
    def mtbf_s(self) -> float:
        """Job mean time between failures ``M = 1 / lam`` in seconds."""
        return 1.0 / self.failure_rate_per_s

    @property
    def restart_cost_s(self) -> float:
        """Checkpoint-restart cost ``R(N)``: restart + rendezvous (log and linear in N) + load."""
        n = self.n_accelerators
        return (
            self.restart_base_s
            + self.restart_per_log2_rank_s * math.log2(n)
            + self.restart_per_rank_s * n
            + self.checkpoint_load_s
        )

    @property
    def state_transfer_s(self) -> float:
        """Per-shard peer state transfer time; independent of ``N``."""
        return self.shard_state_gb / self.peer_bandwidth_gb_s

    @property
    def recovery_cost_s(self) -> float:
        """Checkpointless loss per failure ``L(N)`` excluding spare waits.

        Detection + re-formation (growing with N) + state transfer (constant) + one re-executed
        step.
        """
        n = self.n_accelerators
        lg = math.log2(n)
        detect = self.detect_base_s + self.detect_per_log2_rank_s * lg
        reform = self.reform_base_s + self.reform_per_log2_rank_s * lg + self.reform_per_rank_s * n
        return detect + reform + self.state_transfer_s + self.step_time_s
