"""The autopar model zoo: real train steps to trace, plan and run.

Every model module (:mod:`~benchmarks.models.gpt`, :mod:`~benchmarks.models.moe`,
:mod:`~benchmarks.models.wide_resnet`, :mod:`~benchmarks.models.mlp`,
:mod:`~benchmarks.models.t5`, :mod:`~benchmarks.models.clip`) exposes a frozen
config dataclass with ``.preset(name, **overrides)`` (also at module level, ``preset(name,
**overrides)``) and

``make_train_step(config, batch_size, abstract=True, seed=0) -> (step_fn, (state, batch))``

where ``step_fn(state, batch) -> (new_state, loss)`` is a plain, pure, un-jitted AdamW step
and ``state = {"params", "opt_state"}`` (+ ``"batch_stats"`` for Wide-ResNet).
``abstract=True`` gives ``jax.ShapeDtypeStruct`` leaves and allocates nothing.

Each module is a model family of :mod:`autopar.registry`: ``pyproject.toml`` registers them
under the ``autopar.models`` entry points, which is how ``autopar trace gpt`` and
``autopar demo`` (the ``gpt`` family's ``"demo"`` preset) find them without the library
importing this package.

Example:
    >>> from benchmarks.models import gpt
    >>> step, (state, batch) = gpt.make_train_step(gpt.GPTConfig.preset("gpt2-small"), 8)
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(step)(state, batch)
"""

from benchmarks.models import clip, gpt, mlp, moe, precision, t5, train_step, wide_resnet
from benchmarks.models.clip import CLIPConfig
from benchmarks.models.gpt import GPTConfig
from benchmarks.models.mlp import MLPConfig
from benchmarks.models.moe import MoEConfig
from benchmarks.models.precision import AdamW, Precision
from benchmarks.models.t5 import T5Config
from benchmarks.models.wide_resnet import WideResNetConfig

__all__ = [
    "AdamW",
    "CLIPConfig",
    "GPTConfig",
    "MLPConfig",
    "MoEConfig",
    "Precision",
    "T5Config",
    "WideResNetConfig",
    "clip",
    "gpt",
    "mlp",
    "moe",
    "precision",
    "t5",
    "train_step",
    "wide_resnet",
]
