"""The layer kinds: every sublayer a model can be made of, each one table (one module here).

A new kind (a Mamba mixer, gated delta net, a vision tower's block) is a module with its
``LayerKind`` (its tensors and TE modules, in file order; pgconvert.model.kinds.table) and one entry in
``LAYER_KINDS``; pgconvert.model.layers says which layers are of it. The provider derives every
name, shape, rule and rank-local name from these tables and needs no change.
"""

from __future__ import annotations

from pgconvert.model.kinds import attention, gated_delta_net, mamba, mla, mlp, moe, mtp
from pgconvert.model.kinds.table import LayerKind

# Every kind by name (the names pgconvert.model.layers gives layer specs).
LAYER_KINDS: dict[str, LayerKind] = {
    kind.name: kind for kind in (attention.KIND, mla.KIND, mlp.KIND, moe.KIND, mtp.KIND, mamba.KIND,
                                               gated_delta_net.KIND)
}
