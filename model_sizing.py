"""Pick a transformer shape for a parameter target (pure Python): `choose_shape(target, vocab)`.

The code and the sizing rule are in slm/model/sizing.py.
"""

from slm.errors import SizingError
from slm.model.sizing import (
    ModelShape,
    choose_shape,
    count_params,
    default_learning_rate,
    default_vocab_size,
    describe,
    flops_per_token,
    optimizer_state_bytes,
    param_shapes,
)

__all__ = ["ModelShape", "SizingError", "choose_shape", "count_params", "default_learning_rate",
           "default_vocab_size", "describe", "flops_per_token", "optimizer_state_bytes", "param_shapes"]
