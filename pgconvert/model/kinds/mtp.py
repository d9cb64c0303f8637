"""A multi-token-prediction layer (megatron-core's MultiTokenPredictionLayer,
transformer/multi_token_prediction.py, 0.16.1).

Under ``mtp.layers.{i}.``: enorm and hnorm (the norms of the next token's embedding and of the hidden
state), eh_proj (a ColumnParallelLinear [hidden, 2·hidden], gather_output=False: rows split by TP,
input cat(enorm(emb), hnorm(hidden))), its transformer layer (a decoder layer, pgconvert.model.layers),
and final_layernorm; it has no embedding or output layer of its own (it uses the model's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.model.config import MTP_LAYER_MODULES
from pgconvert.model.kinds.table import InnerLayer, LayerKind, TEModule, TensorKind, hidden, layernorm
from pgconvert.model.layers import MTP
from pgconvert.model.rules import COLUMN, REPLICATED

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

# The inner layer's module: megatron-core 0.16.1's spelling is the canonical one; a rank file may spell
# it as ModelConfig.mtp_layer_module says.
MTP_LAYER_MODULE = MTP_LAYER_MODULES[0] + "."
MTP_EH_PROJ = "eh_proj"


def _local_layer_module(config: ModelConfig) -> str:
    return config.mtp_layer_module + "."


INNER_LAYER = InnerLayer(MTP_LAYER_MODULE, _local_layer_module)

KIND = LayerKind(MTP, tensors=(
    TensorKind("enorm.weight", hidden, REPLICATED, norm_weight=True),
    TensorKind("enorm.bias", hidden, REPLICATED, layernorm),
    TensorKind("hnorm.weight", hidden, REPLICATED, norm_weight=True),
    TensorKind("hnorm.bias", hidden, REPLICATED, layernorm),
    TensorKind(MTP_EH_PROJ + ".weight", lambda c: (c.hidden_size, 2 * c.hidden_size), COLUMN),
    INNER_LAYER,
    TensorKind("final_layernorm.weight", hidden, REPLICATED, norm_weight=True),
    TensorKind("final_layernorm.bias", hidden, REPLICATED, layernorm),
), te_modules=(TEModule(MTP_EH_PROJ), INNER_LAYER))
