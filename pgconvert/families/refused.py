"""Hugging Face architectures pgconvert knows and refuses, each with what megatron-core 0.16.1 cannot compute.

A family is added only where a Megatron run of the converted checkpoint computes what transformers does; these
architectures have a part no megatron-core setting expresses, so a conversion would hand Megatron a model it runs
differently. ``pgconvert.formats.hf.family_of`` names the reason when a config.json names one of them.
"""

from __future__ import annotations

REFUSED_ARCHITECTURES: dict[str, str] = {
    # transformers' ApertusMLP: down_proj(xielu(up_proj(x))), XIELUActivation with a learned alpha_p and alpha_n
    # per layer (activations.py); megatron-core's MLP takes activation_func from its fixed choices and holds no
    # parameter of an activation, and neither megatron-core nor Megatron-LM has an xIELU.
    "ApertusForCausalLM": "its MLP activation is xIELU with learned alpha_p/alpha_n per layer, which megatron-core has "
                          "no activation (nor tensor) for",
    # transformers' PhiForCausalLM: self.lm_head = nn.Linear(hidden_size, vocab_size, bias=True) (modeling_phi.py),
    # always; megatron-core's GPTModel builds its output_layer with bias=False and holds no tensor for it (nor does
    # Megatron-LM have an argument that adds one), so the logits could not be computed from a Megatron checkpoint.
    "PhiForCausalLM": "its lm_head adds a learned bias to every logit, which megatron-core's output layer (built "
                      "without a bias) has no tensor for",
    # transformers' sparsemixer (modeling_phimoe.py): the top-1 expert, then the best of the others, each weighted by
    # a softmax over the router logits within a relative threshold (2 * router_jitter_noise) of that choice's logit;
    # megatron-core's router weighs its top-k by one softmax or sigmoid over all logits
    # (moe_router_score_function).
    "PhimoeForCausalLM": "its router is sparsemixer (each chosen expert weighted by a softmax over the logits within "
                         "router_jitter_noise of it), which megatron-core's softmax/sigmoid top-k router does not "
                         "compute",
}
