"""Run the multi-scale deformable attention of Hugging Face transformers models on cute_deform.

    import cute_deform.integrations.transformers as cdt
    cdt.patch(model)    # every MSDA module in model now runs torch.ops.cute_deform.forward_fused
    cdt.unpatch(model)  # back to transformers' own forward

`patch` finds every module with Deformable DETR's attention layers and sizes (`sampling_offsets`,
`attention_weights`, `value_proj`, `output_proj`, `n_heads`, `n_levels`, `n_points`): Deformable
DETR, Grounding DINO (and MM Grounding DINO), Mask2Former's and OneFormer's pixel decoders, RT-DETR,
and any other model whose module has the same structure. It replaces that instance's forward with
one that computes the same thing, with the module's own weights: value projection and padding mask
as the module does them, then `forward_fused` (locations and softmax inside the op), then
output_proj. Whether a module has the same structure is decided from its forward's source, statement
by statement (its mask convention included); a module with those layers whose forward differs
(RT-DETR v2: scaled offsets) is left as it is, with a warning naming what differs. Modules without
them (D-FINE's decoder attention, which has no value_proj) are not MSDA layers of this kind and are
not touched.

The patched forward returns what the original returns, `(output, attention_weights)`, except that
the attention weights (a softmax that the fused op never materializes) are computed only when
someone can see them: `output_attentions=True` given to the module, or to the patched model's call
(or set in its config); otherwise that slot is None.

No transformers import is needed here: modules are recognized by duck typing, so this works with
any transformers version whose module forward matches (tested: see tests/test_transformers.py).
"""
from __future__ import annotations

import functools
import inspect
import re
import types
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..fused import forward_fused as _forward_fused

__all__ = ["patch", "unpatch", "is_patched"]

_LAYER_ATTRIBUTES = ("sampling_offsets", "attention_weights", "value_proj", "output_proj")
_SIZE_ATTRIBUTES = ("n_heads", "n_levels", "n_points", "d_model")
_ORIGINAL = "_cute_deform_original_forward"  # on a patched module: what `forward` was before
_NO_INSTANCE_FORWARD = object()  # the module had no forward of its own (the class's ran)
_MODEL_STATE = "_cute_deform_patch_state"  # on a model patch() was called on: its hooks and flag


class MSDAPatchWarning(UserWarning):
    """A module looks like multi-scale deformable attention but its forward is not Deformable DETR's."""


# What the module's forward must do, as whitespace-free source fragments (alternatives where
# transformers' models spell the same thing differently), in the order they run.
_REQUIRED = {
    "position embeddings added to the queries": (
        "hidden_states=hidden_states+position_embeddings",
        "hidden_states=self.with_pos_embed(hidden_states,position_embeddings)",
    ),
    "value = value_proj(encoder_hidden_states)": ("value=self.value_proj(encoder_hidden_states)",),
    "value viewed as (N, S, n_heads, d_model // n_heads)": (
        "value=value.view(batch_size,sequence_length,self.n_heads,self.d_model//self.n_heads)",
    ),
    "offsets viewed as (N, Lq, n_heads, n_levels, n_points, 2)": (
        "sampling_offsets=self.sampling_offsets(hidden_states).view(batch_size,num_queries,self.n_heads,"
        "self.n_levels,self.n_points,2)",
    ),
    "logits viewed as (N, Lq, n_heads, n_levels * n_points)": (
        "attention_weights=self.attention_weights(hidden_states).view(batch_size,num_queries,self.n_heads,"
        "self.n_levels*self.n_points)",
    ),
    "softmax over the last dim, viewed as (N, Lq, n_heads, n_levels, n_points)": (
        "attention_weights=F.softmax(attention_weights,-1).view(batch_size,num_queries,self.n_heads,"
        "self.n_levels,self.n_points)",
        "attention_weights=nn.functional.softmax(attention_weights,-1).view(batch_size,num_queries,"
        "self.n_heads,self.n_levels,self.n_points)",
    ),
    "offsets normalized by (W, H) for 2-d reference points": (
        "offset_normalizer=torch.stack([spatial_shapes[...,1],spatial_shapes[...,0]],-1)",
        "offset_normalizer=torch.tensor([[shape[1],shape[0]]forshapeinspatial_shapes_list]",
    ),
    "2-d locations ref + offset / (W, H)": (
        "sampling_locations=(reference_points[:,:,None,:,None,:]+sampling_offsets/"
        "offset_normalizer[None,None,None,:,None,:])",
    ),
    "4-d locations ref[:2] + offset / n_points * ref[2:] * 0.5": (
        "sampling_locations=(reference_points[:,:,None,:,None,:2]+sampling_offsets/self.n_points*"
        "reference_points[:,:,None,:,None,2:]*0.5)",
    ),
    "output_proj of the attention output": ("output=self.output_proj(output)",),
    "returns (output, attention_weights)": ("returnoutput,attention_weights",),
}
# The padding mask: which convention the module uses (True = keep the pixel, or True = padding).
_MASK = re.compile(r"value=value\.masked_fill\((~?)attention_mask\[\.\.\.,None\],(?:float\(0\)|0\.0|0)\)")
_REQUIRED_ARGUMENTS = ("hidden_states", "attention_mask", "encoder_hidden_states", "position_embeddings",
                       "reference_points", "level_start_index")


@dataclass(frozen=True)
class _ForwardSpec:
    """What a module class's forward takes and how it treats its padding mask."""

    positional: tuple[str, ...]  # parameter names a positional call fills, in order
    defaults: dict  # parameter name -> default value
    any_keyword: bool  # the forward takes **kwargs (unknown keywords are ignored, as there)
    mask_is_keep: bool  # attention_mask True = keep the pixel (Deformable DETR); else True = padding


def _code_without_comments_and_spaces(function) -> str:
    source = inspect.getsource(inspect.unwrap(function))
    lines = [line.split("#", 1)[0] for line in source.splitlines()]
    return re.sub(r"\s+", "", "\n".join(lines))


@functools.lru_cache(maxsize=None)
def _forward_spec(cls: type) -> _ForwardSpec | str:
    """The class's forward spec, or why its forward is not Deformable DETR's (a short reason)."""
    try:
        code = _code_without_comments_and_spaces(cls.forward)
    except (OSError, TypeError) as exc:
        return f"the source of {cls.__name__}.forward is not available ({exc})"
    for what, spellings in _REQUIRED.items():
        if not any(spelling in code for spelling in spellings):
            return f"its forward does not compute {what} as Deformable DETR's does"
    masks = {match.group(1) for match in _MASK.finditer(code)}
    if len(masks) != 1:
        return "its forward does not apply attention_mask to value with one masked_fill as Deformable DETR's does"
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    names = {p.name for p in parameters}
    missing = [name for name in _REQUIRED_ARGUMENTS if name not in names]
    if "spatial_shapes" not in names and "spatial_shapes_list" not in names:
        missing.append("spatial_shapes or spatial_shapes_list")
    if missing:
        return f"its forward has no argument {', '.join(missing)}"
    positional = tuple(p.name for p in parameters
                       if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return _ForwardSpec(positional, defaults, any_keyword, mask_is_keep=masks == {"~"})


def _looks_like_msda(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in _LAYER_ATTRIBUTES) and all(
        isinstance(getattr(module, name, None), int) for name in _SIZE_ATTRIBUTES
    )


def _sizes_problem(module: nn.Module) -> str | None:
    """Why the module's layer sizes are not Deformable DETR's for its n_heads / n_levels / n_points."""
    M, L, P, C = module.n_heads, module.n_levels, module.n_points, module.d_model
    expected = {"sampling_offsets": M * L * P * 2, "attention_weights": M * L * P}
    for name, features in expected.items():
        got = getattr(getattr(module, name), "out_features", features)
        if got != features:
            return f"{name} has {got} outputs, not n_heads*n_levels*n_points{'*2' if name[0] == 's' else ''} = {features}"
    if M < 1 or C % M:
        return f"d_model={C} is not a multiple of n_heads={M}"
    return None


class _PatchState:
    """Per patched model: whether its current call asked for attention weights."""

    def __init__(self):
        self.model_wants_weights = False
        self.handles = []


@functools.lru_cache(maxsize=64)
def _cpu_level_tables(shapes: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """spatial_shapes and level_start_index on the CPU for a spatial_shapes_list (the op keeps cached
    device copies of CPU tables, so no copy per call)."""
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64).view(-1, 2)
    pixels = spatial_shapes.prod(-1)
    return spatial_shapes, pixels.cumsum(0) - pixels


def _fused_forward_for(spec: _ForwardSpec, state: _PatchState, in_place_mask: bool):
    """The replacement forward of one module (bound to it)."""
    positional, defaults, any_keyword, mask_is_keep = spec.positional, spec.defaults, spec.any_keyword, spec.mask_is_keep
    known = set(positional) | set(defaults)

    def forward(self, *args, **kwargs):
        if args:
            if len(args) > len(positional):
                raise TypeError(f"{type(self).__name__}.forward takes {len(positional)} positional arguments, "
                                f"got {len(args)}")
            for name, arg in zip(positional, args):
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__}.forward got multiple values for argument '{name}'")
                kwargs[name] = arg
        if not any_keyword and not kwargs.keys() <= known:
            unknown = sorted(kwargs.keys() - known)
            raise TypeError(f"{type(self).__name__}.forward got an unexpected keyword argument '{unknown[0]}'")

        def arg(name):
            return kwargs[name] if name in kwargs else defaults.get(name)

        hidden_states = kwargs.get("hidden_states")
        if hidden_states is None:
            raise TypeError(f"{type(self).__name__}.forward missing required argument 'hidden_states'")
        position_embeddings = arg("position_embeddings")
        if position_embeddings is not None:
            hidden_states = hidden_states + position_embeddings
        encoder_hidden_states = arg("encoder_hidden_states")
        reference_points = arg("reference_points")
        spatial_shapes = arg("spatial_shapes")
        spatial_shapes_list = arg("spatial_shapes_list")
        level_start_index = arg("level_start_index")
        attention_mask = arg("attention_mask")

        N, Lq, _ = hidden_states.shape
        _, S, _ = encoder_hidden_states.shape
        M, L, P = self.n_heads, self.n_levels, self.n_points
        # The original checks S against the level sizes; so do we where that is free (a list, or a
        # table on the CPU outside tracing), never reading a GPU tensor (a host sync). The op checks
        # CPU tables again when it runs.
        if spatial_shapes_list is not None or (
            isinstance(spatial_shapes, torch.Tensor) and spatial_shapes.is_cpu and not torch.compiler.is_compiling()
        ):
            levels = spatial_shapes.tolist() if spatial_shapes_list is None else spatial_shapes_list
            total = sum(height * width for height, width in levels)
            if total != S:
                which = "spatial_shapes" if spatial_shapes_list is None else "spatial_shapes_list"
                raise ValueError(
                    f"cute_deform: encoder_hidden_states: expected sequence length sum(H*W) = {total} over "
                    f"{which} {[list(level) for level in levels]}, got {S}"
                )
        if not isinstance(spatial_shapes, torch.Tensor):
            spatial_shapes, level_start_index = _cpu_level_tables(
                tuple(tuple(int(size) for size in shape) for shape in (spatial_shapes_list or spatial_shapes))
            )
        elif level_start_index is None:
            pixels = spatial_shapes.prod(-1)
            level_start_index = pixels.cumsum(0) - pixels

        if reference_points.shape[:3] != (N, Lq, L):
            # The original broadcasts (RT-DETR passes one box for all levels): the op takes every level's.
            reference_points = reference_points.expand(N, Lq, L, reference_points.shape[-1])

        value = self.value_proj(encoder_hidden_states)
        if attention_mask is not None:
            drop = ~attention_mask[..., None] if mask_is_keep else attention_mask[..., None]
            value = value.masked_fill_(drop, 0.0) if in_place_mask else value.masked_fill(drop, 0.0)
        value = value.view(N, S, M, self.d_model // M)
        offsets = self.sampling_offsets(hidden_states).view(N, Lq, M, L, P, 2)
        logits = self.attention_weights(hidden_states).view(N, Lq, M, L, P)
        output = _forward_fused(value, spatial_shapes, level_start_index, reference_points, offsets, logits)
        output = self.output_proj(output)

        weights = None
        if arg("output_attentions") or state.model_wants_weights:
            weights = torch.softmax(logits.reshape(N, Lq, M, L * P), -1).view(N, Lq, M, L, P)
        return output, weights

    return forward


def is_patched(module: nn.Module) -> bool:
    """Whether module's forward is cute_deform's (set by patch)."""
    return hasattr(module, _ORIGINAL)


def _install_model_hooks(model: nn.Module) -> _PatchState:
    state = getattr(model, _MODEL_STATE, None)
    if state is not None:
        return state
    state = _PatchState()

    def before(module, args, kwargs):
        wanted = kwargs.get("output_attentions")
        if wanted is None:
            wanted = getattr(getattr(module, "config", None), "output_attentions", False)
        state.model_wants_weights = bool(wanted)

    def after(module, args, kwargs, output):
        state.model_wants_weights = False

    state.handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]
    setattr(model, _MODEL_STATE, state)
    return state


def patch(model: nn.Module) -> int:
    """Make every multi-scale deformable attention module in model (model itself included) run
    torch.ops.cute_deform.forward_fused; returns how many of model's modules run it now.

    Idempotent: modules already patched are left as they are. Modules that look like MSDA but whose
    forward is not Deformable DETR's are left alone, with an MSDAPatchWarning saying what differs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cute_deform: model: expected a torch.nn.Module, got {type(model).__name__}")
    state = None
    patched = 0
    refused: dict[str, str] = {}
    for name, module in model.named_modules():
        if is_patched(module):
            patched += 1
            continue
        if not _looks_like_msda(module):
            continue
        spec = _forward_spec(type(module))
        problem = spec if isinstance(spec, str) else _sizes_problem(module)
        if problem is not None:
            refused.setdefault(f"{type(module).__name__} ({name or 'the model'})", problem)
            continue
        if state is None:
            state = _install_model_hooks(model)
        forward = _fused_forward_for(spec, state, in_place_mask=type(module.value_proj) is nn.Linear)
        setattr(module, _ORIGINAL, module.__dict__.get("forward", _NO_INSTANCE_FORWARD))
        module.forward = types.MethodType(forward, module)
        patched += 1
    for where, problem in refused.items():
        warnings.warn(f"cute_deform: not patched: {where}: {problem}", MSDAPatchWarning, stacklevel=2)
    return patched


def unpatch(model: nn.Module) -> int:
    """Give every module of model patched by `patch` its original forward back; returns how many."""
    restored = 0
    for module in model.modules():
        if not is_patched(module):
            continue
        original = getattr(module, _ORIGINAL)
        delattr(module, _ORIGINAL)
        if original is _NO_INSTANCE_FORWARD:
            del module.forward
        else:
            module.forward = original
        restored += 1
    for module in model.modules():
        state = module.__dict__.get(_MODEL_STATE)
        if state is not None:
            for handle in state.handles:
                handle.remove()
            delattr(module, _MODEL_STATE)
    return restored
