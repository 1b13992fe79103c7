"""cute_deform.nn.MSDeformAttn: Deformable DETR's parameter names, shapes and init; a state dict saved
under those names loads strictly; forward equals a hand-written computation from that state dict."""
import io
import math

import pytest
import torch

from cute_deform import ms_deform_attn_reference
from cute_deform.nn import MSDeformAttn
from msda_testing import level_tensors, rel_err


def deformable_detr_state_dict(gen, d_model, n_levels, n_heads, n_points):
    """Random tensors under Deformable DETR's MSDeformAttn parameter names and shapes."""
    samples = n_heads * n_levels * n_points
    shapes = {
        "sampling_offsets.weight": (samples * 2, d_model), "sampling_offsets.bias": (samples * 2,),
        "attention_weights.weight": (samples, d_model), "attention_weights.bias": (samples,),
        "value_proj.weight": (d_model, d_model), "value_proj.bias": (d_model,),
        "output_proj.weight": (d_model, d_model), "output_proj.bias": (d_model,),
    }
    return {name: torch.randn(shape, generator=gen) / math.sqrt(d_model) for name, shape in shapes.items()}


def manual_forward(sd, query, reference_points, flat, shapes, starts, mask, n_heads, n_levels, n_points):
    """Deformable DETR's module written out in float64 from the state dict, on the float64 reference."""
    sd = {k: v.double() for k, v in sd.items()}
    query, reference_points, flat = query.double(), reference_points.double(), flat.double()
    N, Lq, C = query.shape
    S = flat.shape[1]
    M, L, P = n_heads, n_levels, n_points

    value = flat @ sd["value_proj.weight"].T + sd["value_proj.bias"]
    if mask is not None:
        value = value * (~mask)[..., None].double()
    value = value.reshape(N, S, M, C // M)
    offsets = (query @ sd["sampling_offsets.weight"].T + sd["sampling_offsets.bias"]).reshape(N, Lq, M, L, P, 2)
    logits = (query @ sd["attention_weights.weight"].T + sd["attention_weights.bias"]).reshape(N, Lq, M, L * P)
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    weights = (weights / weights.sum(-1, keepdim=True)).reshape(N, Lq, M, L, P)

    locations = torch.empty_like(offsets)
    for level, (height, width) in enumerate(shapes.tolist()):
        for axis, size in ((0, width), (1, height)):
            ref = reference_points[:, :, None, level, None, axis]  # (N, Lq, 1, 1)
            off = offsets[:, :, :, level, :, axis]
            if reference_points.shape[-1] == 2:  # offsets in pixels of this level
                locations[:, :, :, level, :, axis] = ref + off / size
            else:  # offsets in units of half the box size, over P points
                box = reference_points[:, :, None, level, None, 2 + axis]
                locations[:, :, :, level, :, axis] = ref + off / P * box * 0.5
    out = ms_deform_attn_reference(value, shapes, starts, locations, weights)
    return out @ sd["output_proj.weight"].T + sd["output_proj.bias"]


def test_parameter_names_and_shapes_default_config():
    module = MSDeformAttn()
    shapes = {name: tuple(p.shape) for name, p in module.state_dict().items()}
    assert shapes == {
        "sampling_offsets.weight": (256, 256), "sampling_offsets.bias": (256,),
        "attention_weights.weight": (128, 256), "attention_weights.bias": (128,),
        "value_proj.weight": (256, 256), "value_proj.bias": (256,),
        "output_proj.weight": (256, 256), "output_proj.bias": (256,),
    }


def test_reset_parameters_matches_deformable_detr_init():
    d_model, n_levels, n_heads, n_points = 64, 3, 8, 4
    module = MSDeformAttn(d_model, n_levels, n_heads, n_points)
    assert torch.equal(module.sampling_offsets.weight, torch.zeros_like(module.sampling_offsets.weight))
    for name in ("attention_weights.weight", "attention_weights.bias", "value_proj.bias", "output_proj.bias"):
        tensor = module.get_parameter(name)
        assert torch.equal(tensor, torch.zeros_like(tensor)), name
    # Head m points along angle 2*pi*m/M (scaled so max(|x|, |y|) = 1); point p is p+1 steps out.
    bias = module.sampling_offsets.bias.view(n_heads, n_levels, n_points, 2)
    for m in range(n_heads):
        angle = 2 * math.pi * m / n_heads
        x, y = math.cos(angle), math.sin(angle)
        scale = max(abs(x), abs(y))
        for p in range(n_points):
            want = torch.tensor([x / scale * (p + 1), y / scale * (p + 1)]).expand(n_levels, 2)
            torch.testing.assert_close(bias[m, :, p], want, rtol=1e-6, atol=1e-6)
    # Xavier uniform: U(-b, b) with b = sqrt(6 / (fan_in + fan_out)), standard deviation b / sqrt(3).
    bound = math.sqrt(6 / (2 * d_model))
    for linear in (module.value_proj, module.output_proj):
        assert linear.weight.abs().max() <= bound
        assert abs(linear.weight.std().item() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_checkpoint_state_dict_loads_and_forward_matches(gen, ref_dim):
    d_model, n_levels, n_heads, n_points = 32, 3, 4, 3
    N, Lq = 2, 7
    state = deformable_detr_state_dict(gen, d_model, n_levels, n_heads, n_points)
    buffer = io.BytesIO()
    torch.save(state, buffer)  # round-trip through a checkpoint file
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    module = MSDeformAttn(d_model, n_levels, n_heads, n_points)
    result = module.load_state_dict(checkpoint, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(module.state_dict()[k], v) for k, v in state.items())

    query, reference_points, flat, shapes, starts, mask = random_layer_inputs(gen, n_levels, d_model, ref_dim,
                                                                               N=N, Lq=Lq)

    with torch.no_grad():
        out = module(query, reference_points, flat, shapes, starts, mask)
        unmasked = module(query, reference_points, flat, shapes, starts)
    assert out.shape == (N, Lq, d_model) and out.dtype == torch.float32
    expected = manual_forward(state, query, reference_points, flat, shapes, starts, mask, n_heads, n_levels, n_points)
    assert rel_err(out, expected) < 1e-5
    expected_unmasked = manual_forward(state, query, reference_points, flat, shapes, starts, None,
                                       n_heads, n_levels, n_points)
    assert rel_err(unmasked, expected_unmasked) < 1e-5
    assert rel_err(unmasked, expected) > 1e-3  # the mask really changed something


def test_module_rejects_bad_configuration_and_reference_points(gen):
    with pytest.raises(ValueError, match=r"d_model: expected a multiple of n_heads=8, got 100"):
        MSDeformAttn(d_model=100, n_heads=8)
    module = MSDeformAttn(d_model=16, n_levels=1, n_heads=2, n_points=2)
    shapes, starts = level_tensors([(3, 3)])
    query = torch.randn((1, 4, 16), generator=gen)
    flat = torch.randn((1, 9, 16), generator=gen)
    with pytest.raises(ValueError, match=r"reference_points: expected last dim 2 \(x, y\) or 4"):
        module(query, torch.rand((1, 4, 1, 3), generator=gen), flat, shapes, starts)


def random_layer_inputs(gen, n_levels, d_model, ref_dim, *, levels=((6, 9), (3, 5), (1, 2)), N=2, Lq=7):
    shapes, starts = level_tensors(list(levels[:n_levels]))
    S = int(shapes.prod(-1).sum())
    query = torch.randn((N, Lq, d_model), generator=gen)
    flat = torch.randn((N, S, d_model), generator=gen)
    if ref_dim == 2:
        reference_points = torch.rand((N, Lq, n_levels, 2), generator=gen)
    else:
        centre = torch.rand((N, Lq, 1, 2), generator=gen)
        size = 0.05 + 0.5 * torch.rand((N, Lq, 1, 2), generator=gen)
        reference_points = torch.cat([centre, size], -1).expand(N, Lq, n_levels, 4)
    mask = torch.rand((N, S), generator=gen) < 0.3
    return query, reference_points, flat, shapes, starts, mask


def unfused_forward(module, query, reference_points, flat, shapes, starts, mask):
    """MSDeformAttn.forward as it was before the fused op: locations and softmax with torch ops in the
    layers' dtype, masked_fill, then torch.ops.cute_deform.forward."""
    N, Lq, _ = query.shape
    S = flat.shape[1]
    M, L, P = module.n_heads, module.n_levels, module.n_points
    value = module.value_proj(flat)
    if mask is not None:
        value = value.masked_fill(mask[..., None], 0.0)
    value = value.view(N, S, M, module.d_model // M)
    offsets = module.sampling_offsets(query).view(N, Lq, M, L, P, 2)
    weights = module.attention_weights(query).view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    ref = reference_points[:, :, None, :, None, :]
    if reference_points.shape[-1] == 2:
        pixels = shapes.flip(-1).to(device=offsets.device, dtype=offsets.dtype)
        locations = ref + offsets / pixels[None, None, None, :, None, :]
    else:
        locations = ref[..., :2] + offsets / P * ref[..., 2:] * 0.5
    return module.output_proj(torch.ops.cute_deform.forward(value, shapes, starts, locations, weights))


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_fused_forward_equals_the_unfused_formula(gen, ref_dim):
    """fp32: the module (fused op) equals its former unfused formula within fp32 rounding, and both the
    float64 computation from the state dict."""
    d_model, n_levels, n_heads, n_points = 32, 3, 4, 3
    state = deformable_detr_state_dict(gen, d_model, n_levels, n_heads, n_points)
    module = MSDeformAttn(d_model, n_levels, n_heads, n_points)
    module.load_state_dict(state, strict=True)
    inputs = random_layer_inputs(gen, n_levels, d_model, ref_dim)
    with torch.no_grad():
        out = module(*inputs)
        unfused = unfused_forward(module, *inputs)
    expected = manual_forward(state, *inputs, n_heads, n_levels, n_points)
    assert rel_err(out, unfused) < 1e-6
    assert rel_err(out, expected) < 2e-6 and rel_err(unfused, expected) < 2e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_module(gen, dtype):
    """.half() / .to(bf16) weights and inputs, no autocast: output in that dtype, within a few of its
    epsilons of the float64 computation from the (rounded) state dict and inputs."""
    d_model, n_levels, n_heads, n_points = 32, 3, 4, 3
    state = deformable_detr_state_dict(gen, d_model, n_levels, n_heads, n_points)
    module = MSDeformAttn(d_model, n_levels, n_heads, n_points)
    module.load_state_dict(state, strict=True)
    module.to(dtype)
    query, ref, flat, shapes, starts, mask = random_layer_inputs(gen, n_levels, d_model, 2)
    query, ref, flat = query.to(dtype), ref.to(dtype), flat.to(dtype)
    with torch.no_grad():
        out = module(query, ref, flat, shapes, starts, mask)
    assert out.dtype == dtype
    rounded = {k: v.to(dtype) for k, v in state.items()}
    expected = manual_forward(rounded, query, ref, flat, shapes, starts, mask, n_heads, n_levels, n_points)
    assert rel_err(out, expected) < 3 * torch.finfo(dtype).eps


def test_padding_mask_zeroes_values_even_where_they_are_not_finite(gen):
    """Masked pixels' values become 0 whatever the projection gives there (masked_fill, not a multiply:
    NaN and inf features at padding do not leak), and the caller's input_flatten is left as it was."""
    d_model, n_levels, n_heads, n_points = 16, 2, 2, 2
    module = MSDeformAttn(d_model, n_levels, n_heads, n_points)
    module.load_state_dict(deformable_detr_state_dict(gen, d_model, n_levels, n_heads, n_points))
    query, ref, flat, shapes, starts, mask = random_layer_inputs(gen, n_levels, d_model, 2)
    poisoned = flat.clone()
    poisoned[mask] = torch.tensor([math.nan, math.inf] * (d_model // 2))
    kept = poisoned.clone()
    with torch.no_grad():
        out = module(query, ref, poisoned, shapes, starts, mask)
        zeroed = module(query, ref, flat.masked_fill(mask[..., None], 0.0), shapes, starts, mask)
    assert torch.isfinite(out).all()
    assert rel_err(out, zeroed) < 1e-6
    assert torch.equal(poisoned.isnan(), kept.isnan()) and torch.equal(poisoned.nan_to_num(), kept.nan_to_num())


def test_module_under_torch_compile_fullgraph(gen):
    d_model, n_levels, n_heads, n_points = 32, 3, 4, 3
    module = MSDeformAttn(d_model, n_levels, n_heads, n_points)
    module.load_state_dict(deformable_detr_state_dict(gen, d_model, n_levels, n_heads, n_points))
    compiled = torch.compile(module, fullgraph=True)
    for ref_dim in (2, 4):
        inputs = random_layer_inputs(gen, n_levels, d_model, ref_dim)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), module(*inputs), rtol=1e-5, atol=1e-6)


def test_module_is_forward_only(gen):
    """Training-mode calls run, and backpropagating raises instead of returning wrong gradients."""
    module = MSDeformAttn(16, 2, 2, 2)
    inputs = random_layer_inputs(gen, 2, 16, 2)
    out = module(*inputs)
    with pytest.raises(RuntimeError, match="forward only"):
        out.sum().backward()
