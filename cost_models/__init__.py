"""cost_models: hardware, topology, compute, collectives, memory and pipeline schedules.

Pure functions of hardware and sizes (never of jaxprs); ``autopar`` uses them to rank
plans. Every constant carries its source. jax is imported only by ``Cluster.local`` and the
calibration module, lazily.

Example:
    >>> from cost_models import Cluster, collective_time
    >>> c = Cluster.preset("dgx-a100-80gb", nodes=4)
    >>> collective_time("all-reduce", 0, c, {"data": 4, "tensor": 8}, ["data"])
    0.0
"""

from cost_models.cluster import (
    DEFAULT_OVERLAP_EFFICIENCY,
    OVERLAP_EFFICIENCY_2021,
    PRESETS,
    Cluster,
    GroupLayout,
    LinkLevel,
    group_members,
    torus_shape_for,
)
from cost_models.collectives import (
    ALGORITHMS,
    COLLECTIVE_KINDS,
    CollectiveCost,
    best_algorithm,
    bytes_on_wire,
    collective_cost,
    collective_time,
)
from cost_models.compute import OP_KINDS, compute_time, dtype_bytes, matmul_time
from cost_models.devices import (
    DEVICES,
    DeviceSpec,
    canonical_dtype,
    device_for_jax_kind,
    get_device,
)
from cost_models.efficiency import DEFAULT_EFFICIENCY, Efficiency
from cost_models.errors import CostModelError
from cost_models.memory import (
    SCHEDULES,
    ModelStateBreakdown,
    activation_bytes_per_layer_korthikanti,
    gpt_num_params,
    megatron_flops_per_iteration,
    model_state_breakdown,
    model_state_bytes,
    pipeline_activation_multiplier,
    pipeline_p2p_bytes,
    tensor_parallel_bytes_per_layer,
)
from cost_models.overlap import (
    COMM_CLASSES,
    EXPOSED_CLASSES,
    HIDEABLE_CLASSES,
    StepTime,
    bound_linear_overlap,
    compose_step_time,
)
from cost_models.pipeline import ScheduleResult, TimelineEntry, simulate_schedule
from cost_models.profile import (
    CollectiveSample,
    MatmulSample,
    Profile,
    apply_profile,
    fit_matmul_efficiency,
    load_profile,
    save_profile,
)

__version__ = "0.1.0"
COST_MODEL_VERSION = __version__  # recorded in plans next to their predicted costs

__all__ = [
    "ALGORITHMS",
    "COLLECTIVE_KINDS",
    "COMM_CLASSES",
    "EXPOSED_CLASSES",
    "HIDEABLE_CLASSES",
    "COST_MODEL_VERSION",
    "DEFAULT_EFFICIENCY",
    "DEFAULT_OVERLAP_EFFICIENCY",
    "OVERLAP_EFFICIENCY_2021",
    "DEVICES",
    "OP_KINDS",
    "PRESETS",
    "SCHEDULES",
    "Cluster",
    "CollectiveCost",
    "CollectiveSample",
    "CostModelError",
    "DeviceSpec",
    "Efficiency",
    "GroupLayout",
    "LinkLevel",
    "MatmulSample",
    "ModelStateBreakdown",
    "Profile",
    "ScheduleResult",
    "StepTime",
    "TimelineEntry",
    "activation_bytes_per_layer_korthikanti",
    "apply_profile",
    "best_algorithm",
    "bytes_on_wire",
    "canonical_dtype",
    "collective_cost",
    "collective_time",
    "bound_linear_overlap",
    "compose_step_time",
    "group_members",
    "compute_time",
    "device_for_jax_kind",
    "dtype_bytes",
    "fit_matmul_efficiency",
    "get_device",
    "gpt_num_params",
    "load_profile",
    "matmul_time",
    "megatron_flops_per_iteration",
    "model_state_breakdown",
    "model_state_bytes",
    "pipeline_activation_multiplier",
    "pipeline_p2p_bytes",
    "save_profile",
    "simulate_schedule",
    "tensor_parallel_bytes_per_layer",
    "torus_shape_for",
]
