"""Run Megatron-LM's own ``pretrain_gpt.py`` on a CPU-only torch build (one process per rank, gloo).

    torchrun --nproc-per-node 4 scripts/megatron_lm_cpu_train.py MEGATRON_LM_SRC [pretrain_gpt flags]

Used by ``scripts/make_megatron_lm_goldens.py`` to make training checkpoints exactly as
Megatron-LM's ``save_checkpoint`` writes them. It is a launcher with shims, not a reimplementation:
after installing the shims below it runs ``MEGATRON_LM_SRC/pretrain_gpt.py`` with ``runpy`` (its
``__main__``: ``pretrain(...)`` with mock data, the model provider, the optimizer, the scheduler, the
training loop and ``save_checkpoint``). Run it with ``PYTHONPATH=<shared CPU shims>:MEGATRON_LM_SRC``
(the shared ``sitecustomize.py`` is then loaded as well) and pass ``--distributed-backend gloo``.

Shims (each announced on stderr with ``[train-shim]``):
- a ``TorchFunctionMode`` that maps every ``cuda`` device in a torch call (factory functions,
  ``Tensor.to``/``.cuda``) to ``cpu``, so Megatron's ``device='cuda'`` tensors live on the CPU;
- the device generator is the CPU one: ``torch.cuda`` RNG calls and Megatron's RNG tracker act
  on the CPU generator. So CPU-side draws that a GPU run keeps apart (a data loader's seed, drawn
  on tensor-parallel rank 0 only) move the dropout masks of one TP rank: run with
  ``--hidden-dropout 0 --attention-dropout 0``, or the replicated norm weights drift apart between
  TP ranks, which never happens on a GPU;
- ``torch.compile`` disabled (eager functions);
- ``torch.cuda`` queries answered as for one visible device (``device_count``, ``current_device``,
  ``set_device``, streams, events, ``synchronize``, memory statistics) -- no-ops or zeros;
- data loaders never pin memory: the pinning thread asks ``torch.accelerator`` for the device, which a
  CUDA build of torch on a machine without a driver cannot answer (the CPU build never pins);
- ``torch.accelerator`` reports none, as on the CPU build: with ``torch.cuda.is_available`` shimmed to True
  a CUDA build would name CUDA, and ``torch.optim``'s graph-capture check in every Adam step would then
  initialise the missing driver;
- the multi-token prediction layer's check for Transformer Engine's inference linears answers False (without TE
  they are placeholders, and its ``isinstance`` raises);
- multi-latent attention's core attention takes ``k_channels``/``v_channels`` in the local DotProductAttention when
  both equal ``kv_channels`` (only Transformer Engine's attention takes them upstream);
- a Megatron-FSDP save or load with its optimizer state: a rank's parameters whose shard is empty get the Adam state
  torch's Adam never creates for them there (``install_fsdp_empty_shard_state``), or the collectives wait forever.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_seen: set[str] = set()


def _note(name: str, why: str) -> None:
    if name not in _seen:
        _seen.add(name)
        sys.stderr.write(f"[train-shim] {name}: {why}\n")


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, int) and not isinstance(value, bool):  # torch.cuda.current_device()
        return "cpu"
    return value


class CudaToCpu(TorchFunctionMode):
    """Rewrite ``device=cuda...`` arguments of torch calls to the CPU."""

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...): stays where it is (the CPU)
            _note("Tensor.cuda", "tensor kept on the CPU")
            return args[0]
        if name == "to":
            args = tuple(_cpu(a) for a in args)
        if name == "type" and len(args) == 1 and not kwargs:  # clip_grads asserts a cuda type
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if name == "pin_memory":
            return args[0]
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> "_Event":
        return _Event()


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def install() -> None:
    cuda = torch.cuda
    _note("torch.cuda", "one fake device; streams/events no-ops; cuda tensors made on the CPU")
    cuda.device_count = lambda: 1
    cuda.is_available = lambda: True  # initialize_megatron asserts it
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_stream = lambda stream: None
    cuda.empty_cache = lambda: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.memory_stats = lambda device=None: {}
    cuda.mem_get_info = lambda device=None: (0, 0)
    cuda.set_rng_state = lambda state, device="cuda": None
    cuda.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                      range=lambda *a, **k: contextlib.nullcontext())
    torch.nn.Module.cuda = lambda self, device=None: self
    # With torch.cuda.is_available() answering True, a CUDA build's torch.accelerator would name CUDA and
    # its users initialise the driver (torch.optim's graph-capture check in every Adam step asks for the
    # current stream). The CPU build has no accelerator: answer as it does.
    _note("torch.accelerator", "none, as on the CPU build (a CUDA build would initialise the missing driver)")
    torch.accelerator.current_accelerator = lambda check_available=False: None
    torch.accelerator.is_available = lambda: False
    _note("DataLoader", "pin_memory off: its pinning thread would ask a CUDA build of torch for a device")
    loader_init = torch.utils.data.DataLoader.__init__

    def unpinned(self: torch.utils.data.DataLoader, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        loader_init(self, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = unpinned  # type: ignore[method-assign]
    _note("torch.compile", "disabled (the fused-kernel warm-up compiles for a GPU); functions run eagerly")
    torch._dynamo.config.disable = True
    CudaToCpu().__enter__()


def install_dataset_helpers(source: Path, build: Path) -> None:
    """Megatron's ``compile_helpers`` runs ``make`` with the system ``python3`` (whose extension
    suffix may not be this interpreter's) inside the source tree. Build the same ``helpers.cpp``
    for this interpreter in ``build`` (outside the source tree) and register it as
    ``megatron.core.datasets.helpers_cpp``; ``compile_helpers`` then has nothing to do."""
    import importlib.util
    import subprocess
    import sysconfig

    out = build / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not out.is_file():
        build.mkdir(parents=True, exist_ok=True)
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                                  capture_output=True, text=True).stdout.split()
        subprocess.run(["c++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", *includes,
                        str(source / "megatron/core/datasets/helpers.cpp"), "-o", str(out)], check=True)
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["megatron.core.datasets.helpers_cpp"] = module
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: _note("compile_helpers", f"using {out}")


def install_rng() -> None:
    """Megatron's CUDA RNG tracker forks the device generator; on the CPU, the device is the CPU."""
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        _note("cuda rng state", "Megatron's RNG tracker forks the CPU generator")
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def install_sharding_type() -> None:
    """``MLM_DISTOPT_SHARDING_TYPE``: the distributed optimizer's torch_dist form that
    ``save_checkpoint`` asks megatron-core for (Megatron-LM itself picks dp_reshardable or, with
    ``--dist-ckpt-optim-fully-reshardable``, fully_reshardable)."""
    wanted = os.environ.get("MLM_DISTOPT_SHARDING_TYPE")
    if not wanted:
        return
    from megatron.training import checkpointing

    build = checkpointing._build_sharded_state_dict_metadata

    def metadata(*args: Any, **kwargs: Any) -> dict:
        built = build(*args, **kwargs)
        if "distrib_optim_sharding_type" in built:
            built["distrib_optim_sharding_type"] = wanted
        return built

    checkpointing._build_sharded_state_dict_metadata = metadata
    _note("distrib_optim_sharding_type", wanted)


def install_distopt_step_fix() -> None:
    """Opt-in (``PGCONVERT_FIX_DISTOPT_STEP=1``; the resume check sets it, the goldens never do): bugs of
    Megatron-LM's ``DistributedOptimizer`` when it resumes with torch's Adam (no Apex/Transformer Engine,
    as on any CPU), which keeps a ``step`` tensor per parameter. They stop even an unconverted checkpoint
    from resuming. Lines of megatron/core/optimizer/distrib_optimizer.py at d98e8a64 (megatron-core
    0.16.1 in brackets):

    - ``load_state_dict`` (1024-1032 [817-825]) gives every Adam state the same ``step`` tensor, made
      from the param groups' step; Adam's step then adds 1 to it once per parameter;
    - ``load_parameter_state`` -> ``_set_main_param_and_optimizer_states`` (1217-1223 [938-940]) copies
      every key of the state, ``step`` included, from the file's tensors, which hold only ``param``,
      ``exp_avg`` and ``exp_avg_sq``: ``KeyError: 'step'`` (per-rank ``distrib_optim.pt``);
    - torch_dist ``dp_reshardable``: ``sharded_param_state_dp_reshardable`` keeps each state's ``step``
      as a ``LocalNonpersistentObject`` (1963-1966 [1664-1667]), the tensor from before
      ``load_state_dict`` set the checkpoint's step, and ``load_parameter_state_from_dp_reshardable``
      hands that stale step to ``_set_main_param_and_optimizer_states`` (2103 [1804]), which copies it
      over the loaded one.

    Where the per-parameter state is set, each parameter gets its own copy of the step
    ``load_state_dict`` gave it (megatron-core's rule: the step comes from the param groups), whatever
    step the caller handed in; the file's tensors are set as Megatron sets them."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        _note("DistributedOptimizer step", "each parameter's own Adam step, as load_state_dict set it")
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def install_distopt_sharded_load_fix() -> None:
    """Opt-in with ``install_distopt_step_fix``: a torch_dist checkpoint of the distributed optimizer
    cannot be loaded with torch's Adam at Megatron-LM d98e8a64. ``load_checkpoint`` ->
    ``generate_state_dict`` (megatron/training/checkpointing.py:1601) -> ``sharded_state_dict(is_loading=True)``
    first calls ``state_dict()`` (distrib_optimizer.py:1534), which asserts that the Adam states hold
    exactly one step (837-839 [megatron-core 0.16.1: 640-642]); a freshly built optimizer holds none:
    ``AssertionError``. With Apex's or TE's FusedAdam the step lives in the param groups.

    Before a sharded load into an optimizer that holds no state yet, every main param gets the state
    torch's Adam gives it before its first step (``exp_avg``/``exp_avg_sq`` zeros and a ``step`` of 0);
    the load overwrites the tensors and ``load_state_dict`` the step.

    Also (any device): ``load_parameter_state_from_dp_reshardable`` (distrib_optimizer.py:2071) lacks the
    ``@torch.no_grad()`` of its ``fully_reshardable`` and ``fully_sharded_model_space`` siblings (2105,
    2368); with fp32 weights (no ``--bf16``/``--fp16``) the main params are views of the model's
    parameters (467), and its copy into them (1225) raises ``RuntimeError: a view of a leaf Variable
    that requires grad is being used in an in-place operation``. It runs under ``torch.no_grad()`` here."""
    from megatron.core.optimizer import distrib_optimizer

    from_dp_reshardable = distrib_optimizer.DistributedOptimizer.load_parameter_state_from_dp_reshardable

    def load_dp_reshardable(self: Any, state_dict: Any) -> None:
        _note("DistributedOptimizer dp_reshardable load", "under torch.no_grad(), as its sibling loads are")
        with torch.no_grad():
            from_dp_reshardable(self, state_dict)

    distrib_optimizer.DistributedOptimizer.load_parameter_state_from_dp_reshardable = load_dp_reshardable
    sharded = distrib_optimizer.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self: Any, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           *args: Any, **kwargs: Any) -> Any:
        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            _note("DistributedOptimizer sharded load", "Adam's initial state (zeros, step 0) before the load")
            for group in self.optimizer.param_groups:
                for main in group["params"]:
                    self.optimizer.state[main] = {"exp_avg": torch.zeros_like(main),
                                                  "exp_avg_sq": torch.zeros_like(main), "step": torch.tensor(0.0)}
        return sharded(self, {} if model_sharded_state_dict is None else model_sharded_state_dict, is_loading,
                       *args, **kwargs)

    distrib_optimizer.DistributedOptimizer.sharded_state_dict = sharded_state_dict


def _fill_empty_shard_state(optimizer: Any) -> None:
    """Adam's state for the parameters of ``optimizer`` (a DistributedOptimizer) whose shard on this rank is empty:
    zeros of the empty shard and the step every other parameter holds (all equal, or this refuses). The state is then
    ordered as the param groups are, as an Adam that steps every parameter (Transformer Engine's or Apex's on a GPU)
    creates it: ``handle_swiglu_in_state_dict`` splits the moments collectively in the state's order, and a rank
    whose filled parameters came last would pair its halves with another parameter's on the other ranks (a gated
    MoE's experts: "DTensor chunk metadata is invalid")."""
    state = optimizer.optimizer.state
    params = [param for group in optimizer.optimizer.param_groups for param in group["params"]]
    missing = [param for param in params if not state.get(param)]
    if not missing or len(missing) == len(params):
        return
    steps = [held["step"] for held in state.values() if "step" in held]
    if any(not torch.equal(steps[0], step) for step in steps) or any(param.to_local().numel() for param in missing):
        raise RuntimeError("Megatron-FSDP Adam state: the steps differ, or a held shard has no state")
    _note("Megatron-FSDP empty-shard Adam state", "zeros of the empty shard and the common step")
    for param in missing:
        state[param] = {"step": steps[0].clone(), "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param)}
    ordered = [(param, state[param]) for param in params]
    state.clear()
    state.update(ordered)


def install_fsdp_empty_shard_state() -> None:
    """Megatron-FSDP's optimizer state on a rank that holds none of a parameter's elements. Its
    ``update_main_grads`` (megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3401 at
    d98e8a64) gives such a parameter no gradient (``grad = None`` for an empty shard), so torch's Adam (no
    Apex/Transformer Engine on a CPU) never creates its state there; ``save_checkpoint`` ->
    ``preprocess_fsdp_dtensor_state_dict`` -> ``handle_swiglu_in_state_dict`` then makes DTensors of the moments
    collectively, key by key, and the ranks whose state lacks a key wait forever. Loading alike:
    ``_init_optimizer_states_with_dummy_values`` skips an empty shard, so its dummy state is missing there too.

    Before ``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` saves, and after the dummy state a load starts
    from, such a parameter gets the state Adam gives every other one: ``exp_avg``/``exp_avg_sq`` zeros of its
    (empty) shard and the step the rank's other parameters hold. No element of any saved or loaded tensor changes."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_param_state_fsdp_dtensor
    dummy = DistributedOptimizer._init_optimizer_states_with_dummy_values

    def sharded_param_state_fsdp_dtensor(self: Any, is_loading: bool = False) -> Any:
        if not is_loading:
            _fill_empty_shard_state(self)
        return original(self, is_loading)

    def init_optimizer_states_with_dummy_values(self: Any) -> None:
        dummy(self)
        _fill_empty_shard_state(self)

    DistributedOptimizer.sharded_param_state_fsdp_dtensor = sharded_param_state_fsdp_dtensor
    DistributedOptimizer._init_optimizer_states_with_dummy_values = init_optimizer_states_with_dummy_values


def install_inference_linear_check() -> None:
    """Megatron-LM d98e8a64's MultiTokenPredictionLayer asks ``is_inference_column_parallel_linear(eh_proj)``
    (megatron/core/transformer/multi_token_prediction.py:1193), an ``isinstance`` over Transformer Engine's
    inference linears; without TE they are placeholders, not classes, and ``isinstance`` raises. No module is one
    of them then: the check answers False."""
    from megatron.core.tensor_parallel import inference_layers
    from megatron.core.transformer import multi_token_prediction

    classes = tuple(cls for cls in (inference_layers.InferenceColumnParallelLinear,
                                    inference_layers.InferenceLayerNormColumnParallelLinear) if isinstance(cls, type))
    if len(classes) == 2:
        return

    def is_inference_column_parallel_linear(module: Any) -> bool:
        _note("inference linear check", "no Transformer Engine inference linears: False for every module")
        return False

    multi_token_prediction.is_inference_column_parallel_linear = is_inference_column_parallel_linear


def install_mla_core_attention() -> None:
    """Megatron-LM d98e8a64's multi-latent attention builds its core attention with ``k_channels`` (the query/key
    head size, ``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (multi_latent_attention.py:214), which only
    Transformer Engine's attention takes; the local spec's DotProductAttention sizes its heads by ``kv_channels``. With
    both equal to ``kv_channels`` the local attention computes the same thing: it takes them then, and refuses other
    sizes by name."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__

    def __init__(self: Any, config: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        if {k_channels, v_channels} - {None, config.kv_channels}:
            raise ValueError(f"DotProductAttention on the CPU: k_channels={k_channels}, v_channels={v_channels} must "
                             f"equal kv_channels={config.kv_channels}")
        if k_channels is not None or v_channels is not None:
            _note("MLA core attention", "k_channels = v_channels = kv_channels: the local DotProductAttention")
        original(self, config, *args, **kwargs)

    DotProductAttention.__init__ = __init__


def main() -> None:
    source = Path(sys.argv[1])
    install()
    install_rng()
    if os.environ.get("PGCONVERT_FIX_DISTOPT_STEP") == "1":
        install_distopt_step_fix()
        install_distopt_sharded_load_fix()
    install_dataset_helpers(source, Path(os.environ.get("MLM_HELPERS_BUILD", "/tmp/megatron_lm_helpers")))
    sys.argv = [str(source / "pretrain_gpt.py"), *sys.argv[2:]]
    install_sharding_type()
    install_fsdp_empty_shard_state()
    install_inference_linear_check()
    install_mla_core_attention()
    runpy.run_path(str(source / "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main()
