"""Memory and size formulas from the papers in ../shared/reference (ZeRO, Korthikanti, Megatron).

These are *reference* formulas: the planner measures activations and parameters from the
traced graph; tests and docs use these to check it, and benchmarks use the GPT ones.

Model state per device (ZeRO, Rajbhandari et al. SC'20), Psi parameters, N_d data-parallel
ranks:

* ``precision="mixed"``: 2 Psi fp16/bf16 parameters, 2 Psi gradients, K Psi = 12 Psi
  optimizer state (fp32 master weights 4, Adam momentum 4, variance 4) = 16 Psi.
* ``precision="fp32"``: 4 Psi parameters, 4 Psi gradients, 8 Psi optimizer state (Adam
  momentum and variance; the parameters are their own master copy) = 16 Psi too.
* ZeRO-1 partitions the optimizer state over N_d, ZeRO-2 also the gradients, ZeRO-3 also
  the parameters.

Example:
    >>> round(model_state_bytes(7.5e9, 1, 64) / 1e9, 1)
    31.4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cost_models.errors import check_choice, check_int, check_positive

ZeroStage = Literal[0, 1, 2, 3]
Precision = Literal["mixed", "fp32"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")

# bytes per parameter: (parameters, gradients, optimizer state); ZeRO paper, K = 12 for mixed.
_STATE_BYTES = {"mixed": (2.0, 2.0, 12.0), "fp32": (4.0, 4.0, 8.0)}


@dataclass(frozen=True)
class ModelStateBreakdown:
    """Model-state bytes per device, by kind.

    Example:
        >>> model_state_breakdown(1e9, 0, 1).total
        16000000000.0
    """

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        """params + grads + optimizer."""
        return self.params + self.grads + self.optimizer


def model_state_breakdown(
    num_params: float, zero_stage: ZeroStage, dp: int, precision: Precision = "mixed"
) -> ModelStateBreakdown:
    """Per-device parameter, gradient and optimizer bytes under a ZeRO stage.

    Args:
        num_params: parameters held by this model replica (after tensor/pipeline splits).
        zero_stage: 0 (plain data parallel), 1, 2 or 3.
        dp: data-parallel ranks the state is partitioned over (N_d).
        precision: ``"mixed"`` (16-bit params/grads, fp32 Adam) or ``"fp32"``.

    Example:
        >>> b = model_state_breakdown(7.5e9, 2, 64)
        >>> round(b.total / 1e9, 1)
        16.6
    """
    check_positive("num_params", num_params, allow_zero=True)
    check_choice("zero_stage", zero_stage, (0, 1, 2, 3))
    dp = check_int("dp", dp)
    check_choice("precision", precision, tuple(_STATE_BYTES))
    p_b, g_b, o_b = _STATE_BYTES[precision]
    return ModelStateBreakdown(
        params=p_b * num_params / (dp if zero_stage >= 3 else 1),
        grads=g_b * num_params / (dp if zero_stage >= 2 else 1),
        optimizer=o_b * num_params / (dp if zero_stage >= 1 else 1),
    )


def model_state_bytes(
    num_params: float, zero_stage: ZeroStage, dp: int, precision: Precision = "mixed"
) -> float:
    """Total model-state bytes per device (ZeRO formulas; see the module docstring).

    Example:
        >>> [round(model_state_bytes(7.5e9, z, 64) / 1e9, 1) for z in (0, 1, 2, 3)]
        [120.0, 31.4, 16.6, 1.9]
    """
    return model_state_breakdown(num_params, zero_stage, dp, precision).total


def activation_bytes_per_layer_korthikanti(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: Recompute = "none",
) -> float:
    """Activation bytes per transformer layer, Korthikanti et al. 2022, Table 2.

    16-bit activations, 1-byte dropout masks; s sequence, b microbatch, h hidden, a heads,
    t tensor-parallel size, sp sequence parallelism.

    * none: ``s b h (10 + 24/t + 5 a s/(h t))`` (t = 1: ``s b h (34 + 5 a s/h)``);
      with sp: ``s b h (34/t + 5 a s/(h t))``.
    * selective (attention core recomputed): ``s b h (10 + 24/t)``; with sp ``34 s b h/t``.
    * full (only the layer input kept): ``2 s b h``, as the table gives it.

    Example:
        >>> activation_bytes_per_layer_korthikanti(2048, 1, 12288, 96, t=8, sp=True, recompute="selective")
        106954752.0
    """
    for name, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        check_int(name, v)
    check_choice("recompute", recompute, ("none", "selective", "full"))
    sbh = float(s) * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn_core = 5.0 * a * s / (h * t)  # softmax output, its dropout mask and output
    if recompute == "selective":
        attn_core = 0.0
    if sp:
        return sbh * (34.0 / t + attn_core)
    return sbh * (10.0 + 24.0 / t + attn_core)


def pipeline_activation_multiplier(schedule: Schedule, p: int, m: int, v: int = 1) -> float:
    """Microbatches' activations held on pipeline stage 0, relative to one microbatch.

    * GPipe: all m forwards run before any backward -> m.
    * 1F1B and zero-bubble (ZB-H1 keeps 1F1B's memory): min(p, m).
    * interleaved 1F1B with v chunks per device: Megatron's warm-up runs
      2(p-1) + (v-1) p chunk-forwards before the first backward, so p v + p - 1 chunk
      activations (each 1/v of the stage) are alive: p (1 + (p-1)/(p v)) microbatches.
      This is Korthikanti's "(1 + (p-1)/(p m))" factor, where their m counts interleaved
      chunks (our v), not microbatches. Capped at m (all of them). v = 1 is plain 1F1B.

    Example:
        >>> pipeline_activation_multiplier("interleaved-1f1b", 4, 8, v=2)
        5.5
    """
    check_choice("schedule", schedule, SCHEDULES)
    p, m, v = check_int("p", p), check_int("m", m), check_int("v", v)
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zero-bubble") or v == 1:
        return float(min(p, m))
    chunks_alive = min(2 * (p - 1) + (v - 1) * p + 1, m * v)
    return chunks_alive / v


def gpt_num_params(l: int, h: int, V: int, s: int) -> float:  # noqa: E741 (paper's names)
    """GPT parameters, Megatron-LM 2021: ``P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))``.

    Example:
        >>> round(gpt_num_params(96, 12288, 51200, 2048) / 1e9, 1)
        174.6
    """
    return 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (V + s) / (12.0 * l * h))


def megatron_flops_per_iteration(
    B: int,
    s: int,
    l: int,  # noqa: E741 (paper's names)
    h: int,
    V: int,
    recompute: bool = True,
) -> float:
    """FLOPs of one training iteration of a GPT, Megatron-LM 2021 (and Korthikanti 2022).

    With full activation recomputation (the paper's accounting, which counts the extra
    forward): ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``. Without:
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``.

    Example:
        >>> f = megatron_flops_per_iteration(1536, 2048, 96, 12288, 51200)
        >>> round(f / 1e18, 2)
        4.51
    """
    for name, val in (("B", B), ("s", s), ("l", l), ("h", h), ("V", V)):
        check_int(name, val)
    if recompute:
        return 96.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (16.0 * l * h))
    return 72.0 * B * s * l * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * l * h))


def tensor_parallel_bytes_per_layer(
    b: int, s: int, h: int, t: int, bytes_per_elem: int = 2
) -> float:
    """Bytes one device sends for tensor parallelism per layer per microbatch.

    Megatron-LM 2021: "tensors of total size b s h need to be all-reduced among t model
    replicas twice each in the forward and backward pass for each layer, leading to a total
    communication of 8 b s h (t-1)/t per layer per device". We read that ``8 b s h (t-1)/t``
    as *elements* (a ring all-reduce of b s h elements sends 2 (t-1)/t b s h of them; four
    all-reduces make 8), hence the "bytes-equivalents" of the reference README, and multiply
    by ``bytes_per_elem``. The two extra all-reduces of a recomputed forward are not
    included (the paper's count ignores recomputation).

    Example:
        >>> tensor_parallel_bytes_per_layer(1, 2048, 12288, 8)
        352321536.0
    """
    for name, val in (("b", b), ("s", s), ("h", h), ("t", t), ("bytes_per_elem", bytes_per_elem)):
        check_int(name, val)
    return 8.0 * b * s * h * (t - 1) / t * bytes_per_elem


def pipeline_p2p_bytes(
    b: int, s: int, h: int, t: int = 1, scatter_gather: bool = False, bytes_per_elem: int = 2
) -> float:
    """Bytes one device sends to the next stage per microbatch: ``b s h`` elements.

    With Megatron's scatter/gather optimisation each of the t tensor-parallel ranks sends
    only its 1/t slice (``b s h / t``) and the receiving node all-gathers it over NVLink.

    Example:
        >>> pipeline_p2p_bytes(1, 2048, 12288, t=8, scatter_gather=True)
        6291456.0
    """
    for name, val in (("b", b), ("s", s), ("h", h), ("t", t), ("bytes_per_elem", bytes_per_elem)):
        check_int(name, val)
    elems = float(b) * s * h
    return elems * bytes_per_elem / (t if scatter_gather else 1)
