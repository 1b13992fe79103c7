"""cute_deform.integrations.transformers: patch() makes transformers' multi-scale deformable attention
modules run the fused op, with the same outputs as transformers' own path (fp32, <= 1e-5 relative),
on every module class of the installed transformers that has Deformable DETR's structure and on small
random-weight models built offline (Deformable DETR, Grounding DINO, Mask2Former, OneFormer, RT-DETR);
unpatch() restores the original path exactly. Skipped where transformers is not installed
(pip install -e ".[transformers]")."""
from __future__ import annotations

import glob
import importlib
import inspect
import math
import os
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cute_deform.integrations.transformers as cdt  # noqa: E402
from msda_testing import finite_rel_err, level_tensors, nonfinite_mismatch, rel_err  # noqa: E402

TOLERANCE = 1e-5  # fp32, relative, against transformers' own path
# Deformable DETR's structure: patched. Families whose module differs (scaled offsets, per-level point
# counts): refused. Both keyed by the class name, as transformers names them.
SAME_STRUCTURE = ("DeformableDetrMultiscaleDeformableAttention", "GroundingDinoMultiscaleDeformableAttention",
                  "Mask2FormerPixelDecoderEncoderMultiscaleDeformableAttention",
                  "OneFormerPixelDecoderEncoderMultiscaleDeformableAttention", "RTDetrMultiscaleDeformableAttention")
OTHER_STRUCTURE = ("RTDetrV2MultiscaleDeformableAttention", "DFineMultiscaleDeformableAttention")


def seed_from(gen) -> int:
    return int(torch.randint(2**62, (1,), generator=gen))


def installed_msda_classes() -> dict[str, type]:
    """Every class of the installed transformers whose name ends in Multi(s|S)caleDeformableAttention and
    that has a sampling_offsets layer (not the parameterless kernel wrappers)."""
    root = os.path.dirname(transformers.models.__file__)
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "modeling_*.py"))):
        with open(path) as file:
            if "sampling_offsets" not in file.read():
                continue
        name = "transformers.models." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        module = importlib.import_module(name)
        for attr, cls in vars(module).items():
            if (isinstance(cls, type) and cls.__module__ == name and attr.lower().endswith("multiscaledeformableattention")
                    and "sampling_offsets" in inspect.getsource(cls)):
                found[attr] = cls
    return found


def build_module(cls, d_model, n_heads, n_levels, n_points):
    """An instance of a transformers MSDA class of the usual constructors, or None."""
    names = list(inspect.signature(cls.__init__).parameters)[1:]
    if names == ["config", "num_heads", "n_points"]:
        config = types.SimpleNamespace(d_model=d_model, num_feature_levels=n_levels, disable_custom_kernels=True)
        return cls(config, n_heads, n_points)
    if names == ["embed_dim", "num_heads", "n_levels", "n_points"]:
        return cls(embed_dim=d_model, num_heads=n_heads, n_levels=n_levels, n_points=n_points)
    return None


def randomize_msda_layers(model, gen):
    """transformers initializes the offset and logit layers' weights to 0 (every query samples the same
    pattern with uniform weights): random weights instead, so the test sees query-dependent locations
    and softmaxes."""
    for module in model.modules():
        if cdt._looks_like_msda(module):
            with torch.no_grad():
                for layer, scale in ((module.sampling_offsets, 1.0), (module.attention_weights, 2.0)):
                    fan_in = layer.weight.shape[1]
                    layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * scale / math.sqrt(fan_in))
                    layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))


def module_inputs(gen, module, d_model, levels, ref_dim, keep_mask: bool, ref_levels=None):
    """Keyword arguments for a module's forward, by the names its signature has; reference points for
    ref_levels levels (default: all; 1 = one for all levels, broadcast as RT-DETR's decoder does)."""
    N, Lq = 2, 5
    shapes, starts = level_tensors(levels)
    S = int(shapes.prod(-1).sum())
    L = len(levels) if ref_levels is None else ref_levels
    if ref_dim == 2:
        ref = torch.rand((N, Lq, L, 2), generator=gen)
    else:
        ref = torch.cat([torch.rand((N, Lq, L, 2), generator=gen), 0.1 + 0.5 * torch.rand((N, Lq, L, 2), generator=gen)], -1)
    padding = torch.rand((N, S), generator=gen) < 0.25
    candidates = dict(
        hidden_states=torch.randn((N, Lq, d_model), generator=gen),
        attention_mask=~padding if keep_mask else padding,
        encoder_hidden_states=torch.randn((N, S, d_model), generator=gen),
        position_embeddings=torch.randn((N, Lq, d_model), generator=gen),
        reference_points=ref,
        spatial_shapes=shapes,
        spatial_shapes_list=[tuple(level) for level in levels],
        level_start_index=starts,
    )
    names = inspect.signature(type(module).forward).parameters
    return {name: value for name, value in candidates.items() if name in names}


def test_module_classes_of_the_installed_transformers(gen):
    """Every MSDA class of the installed transformers: those with Deformable DETR's structure are patched
    and give transformers' output and attention weights (2-d and 4-d reference points, one box for all
    levels, padding mask in the class's own convention); the others are refused with a reason."""
    classes = installed_msda_classes()
    for name in SAME_STRUCTURE:
        assert name in classes, f"{name} not found in transformers {transformers.__version__}"
        assert not isinstance(cdt._forward_spec(classes[name]), str), cdt._forward_spec(classes[name])
    for name in OTHER_STRUCTURE:
        if name in classes:
            assert isinstance(cdt._forward_spec(classes[name]), str), name

    d_model, n_heads, n_points, levels = 32, 4, 3, [(5, 6), (3, 4), (2, 2)]
    tested = []
    for name, cls in classes.items():
        spec = cdt._forward_spec(cls)
        if isinstance(spec, str):
            continue
        module = build_module(cls, d_model, n_heads, len(levels), n_points)
        if module is None:  # a constructor this test does not know: covered by the model tests or not at all
            continue
        module.eval()
        randomize_msda_layers(module, gen)
        for ref_dim, ref_levels in ((2, None), (4, None), (4, 1)):
            kwargs = module_inputs(gen, module, d_model, levels, ref_dim, spec.mask_is_keep, ref_levels)
            with torch.no_grad():
                expected, expected_weights = module(**kwargs)
                assert cdt.patch(module) == 1 and cdt.is_patched(module)
                out, no_weights = module(**kwargs)
                _, weights = module(**kwargs, output_attentions=True)
                assert cdt.unpatch(module) == 1 and not cdt.is_patched(module)
                again, _ = module(**kwargs)
            assert rel_err(out, expected) < TOLERANCE, (name, ref_dim)
            assert no_weights is None and rel_err(weights, expected_weights) < 1e-6, name
            assert torch.equal(again, expected), name
        tested.append(name)
    assert set(SAME_STRUCTURE) <= set(tested)


def test_patched_module_takes_positional_arguments_and_refuses_unknown_ones(gen):
    """Arguments bind as in the original signature (positional included); a keyword the original does
    not take is refused as there, where the original has no **kwargs."""
    from transformers.models.mask2former import modeling_mask2former as m2f

    module = m2f.Mask2FormerPixelDecoderEncoderMultiscaleDeformableAttention(32, 4, 2, 2).eval()
    randomize_msda_layers(module, gen)
    kwargs = module_inputs(gen, module, 32, [(4, 4), (2, 3)], 2, keep_mask=False)
    order = list(inspect.signature(type(module).forward).parameters)[1:]
    positional = [kwargs.get(name) for name in order[:order.index("level_start_index") + 1]]
    with torch.no_grad():
        expected, _ = module(**kwargs)
        cdt.patch(module)
        by_position, _ = module(*positional)
        with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_argument'"):
            module(**kwargs, no_such_argument=None)
        with pytest.raises(TypeError, match="multiple values for argument 'hidden_states'"):
            module(kwargs["hidden_states"], **kwargs)
        with pytest.raises(ValueError, match=r"encoder_hidden_states: expected sequence length sum\(H\*W\) = 22"):
            module(**dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"][:, 1:]))
    assert rel_err(by_position, expected) < TOLERANCE


def test_other_structures_are_left_alone_with_a_warning():
    classes = installed_msda_classes()
    if "RTDetrV2MultiscaleDeformableAttention" not in classes:
        pytest.skip(f"transformers {transformers.__version__} has no RT-DETR v2")
    config = transformers.RTDetrV2Config(d_model=32, decoder_attention_heads=4, decoder_n_points=2, decoder_n_levels=2)
    module = classes["RTDetrV2MultiscaleDeformableAttention"](config)
    holder = torch.nn.ModuleDict({"attn": module})
    with pytest.warns(cdt.MSDAPatchWarning, match=r"not patched: RTDetrV2MultiscaleDeformableAttention \(attn\): "):
        assert cdt.patch(holder) == 0
    assert not cdt.is_patched(module) and "forward" not in module.__dict__


# --- Whole models, built offline from small configs with random weights.


# transformers 4.x configs name a default timm backbone too, which a backbone_config must replace.
NO_NAMED_BACKBONE = {"backbone": None} if int(transformers.__version__.split(".")[0]) < 5 else {}


def resnet_config(out_features):
    return transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                     out_features=out_features)


def deformable_detr(gen):
    config = transformers.DeformableDetrConfig(
        backbone_config=resnet_config(["stage2", "stage3", "stage4"]), use_timm_backbone=False,
        use_pretrained_backbone=False, **NO_NAMED_BACKBONE, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_attention_heads=4, decoder_attention_heads=4, num_queries=10,
        num_feature_levels=4, two_stage=True, with_box_refine=True, two_stage_num_proposals=10)
    model = transformers.DeformableDetrForObjectDetection(config)
    return model, dict(pixel_values=torch.randn((2, 3, 64, 80), generator=gen), pixel_mask=pixel_mask(2, 64, 80)), \
        ("logits", "pred_boxes", "last_hidden_state", "encoder_last_hidden_state")


def grounding_dino(gen):
    text = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=64)
    config = transformers.GroundingDinoConfig(
        backbone_config=resnet_config(["stage2", "stage3", "stage4"]), text_config=text, d_model=32,
        encoder_layers=1, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=4,
        decoder_attention_heads=4, num_queries=10, max_text_len=16, num_feature_levels=4)
    model = transformers.GroundingDinoForObjectDetection(config)
    inputs = dict(pixel_values=torch.randn((2, 3, 64, 80), generator=gen), pixel_mask=pixel_mask(2, 64, 80),
                  input_ids=torch.randint(1, 50, (2, 7), generator=gen), attention_mask=torch.ones((2, 7), dtype=torch.long))
    return model, inputs, ("logits", "pred_boxes", "last_hidden_state", "encoder_last_hidden_state_vision")


def mask2former(gen):
    backbone = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
                                       num_heads=[1, 1, 2, 2], window_size=4,
                                       out_features=["stage1", "stage2", "stage3", "stage4"])
    config = transformers.Mask2FormerConfig(
        backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32,
        dim_feedforward=32, encoder_layers=1, decoder_layers=2, num_attention_heads=4, num_queries=5, num_labels=3)
    model = transformers.Mask2FormerForUniversalSegmentation(config)
    inputs = dict(pixel_values=torch.randn((2, 3, 64, 64), generator=gen), pixel_mask=pixel_mask(2, 64, 64))
    return model, inputs, ("class_queries_logits", "masks_queries_logits", "pixel_decoder_last_hidden_state")


def oneformer(gen):
    backbone = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
                                       num_heads=[1, 1, 2, 2], window_size=4,
                                       out_features=["stage1", "stage2", "stage3", "stage4"])
    config = transformers.OneFormerConfig(
        backbone_config=backbone, conv_dim=32, mask_dim=32, hidden_dim=32, encoder_feedforward_dim=32,
        dim_feedforward=32, encoder_layers=1, decoder_layers=2, num_attention_heads=4, num_queries=6,
        text_encoder_width=32, text_encoder_context_length=8, text_encoder_num_layers=1, text_encoder_vocab_size=50,
        text_encoder_proj_layers=1, num_labels=3, task_seq_len=8, max_seq_len=8, text_encoder_n_ctx=2)
    model = transformers.OneFormerModel(config)
    inputs = dict(pixel_values=torch.randn((2, 3, 64, 64), generator=gen), pixel_mask=pixel_mask(2, 64, 64),
                  task_inputs=torch.randint(0, 50, (2, 8), generator=gen))
    return model, inputs, ("transformer_decoder_object_queries", "transformer_decoder_mask_predictions",
                           "transformer_decoder_class_predictions")


def rt_detr(gen):
    backbone = transformers.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                               out_features=["stage2", "stage3", "stage4"])
    config = transformers.RTDetrConfig(
        backbone_config=backbone, d_model=32, encoder_hidden_dim=32, encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=4, decoder_attention_heads=4, num_queries=10, decoder_layers=2,
        encoder_in_channels=[16, 16, 16], decoder_in_channels=[32, 32, 32])
    model = transformers.RTDetrForObjectDetection(config)
    return model, dict(pixel_values=torch.randn((2, 3, 64, 64), generator=gen)), ("logits", "pred_boxes",
                                                                                 "last_hidden_state")


def pixel_mask(n, height, width):
    """1 = pixel, 0 = padding: the last image padded on the right and bottom."""
    mask = torch.ones((n, height, width), dtype=torch.long)
    mask[-1, :, width * 3 // 4:] = 0
    mask[-1, height * 7 // 8:] = 0
    return mask


MODELS = {"deformable_detr": deformable_detr, "grounding_dino": grounding_dino, "mask2former": mask2former,
          "oneformer": oneformer, "rt_detr": rt_detr}


def flatten(value):
    """The tensors in an output field, in order (fields may be tuples of tensors)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in flatten(item)]


def compare_patched_model(gen, family, monkeypatch) -> list[int]:
    """Runs the model as shipped, patched, and unpatched; checks the outputs; returns the last dim of the
    reference points each fused op call saw."""
    torch.manual_seed(seed_from(gen))
    model, inputs, fields = MODELS[family](gen)
    model.eval()
    randomize_msda_layers(model, gen)
    msda = [m for m in model.modules() if cdt._looks_like_msda(m)]
    assert msda

    with torch.no_grad():
        expected = model(**inputs)
        assert cdt.patch(model) == len(msda) and cdt.patch(model) == len(msda)  # twice: no-op
        calls = []
        fused = cdt._forward_fused
        monkeypatch.setattr(cdt, "_forward_fused", lambda *args: calls.append(args[3].shape[-1]) or fused(*args))
        patched = model(**inputs)
        assert len(calls) == len(msda)  # every module (each runs once per forward in these models)
        monkeypatch.undo()
        assert cdt.unpatch(model) == len(msda) and cdt.unpatch(model) == 0
        restored = model(**inputs)

    for field in fields:
        for want, got, again in zip(flatten(expected[field]), flatten(patched[field]), flatten(restored[field]),
                                    strict=True):
            # -inf where a model masks (Grounding DINO's logits of padded text tokens): the same places.
            assert nonfinite_mismatch(got, want) is None, field
            assert finite_rel_err(got, want) < TOLERANCE, field
            assert torch.equal(again, want), field
    assert all("forward" not in m.__dict__ for m in msda)
    return calls


@pytest.mark.parametrize("family", MODELS)
def test_patched_model_matches_transformers(gen, family, monkeypatch):
    """fp32, eval: the patched model's outputs equal transformers' own (<= 1e-5 relative); every MSDA
    module ran the fused op; unpatch gives back transformers' outputs bit for bit."""
    compare_patched_model(gen, family, monkeypatch)


def test_models_use_2d_and_4d_reference_points(gen, monkeypatch):
    """Deformable DETR (two-stage) samples around 2-d points in its encoder and 4-d boxes in its decoder:
    both kinds reach the fused op."""
    calls = compare_patched_model(gen, "deformable_detr", monkeypatch)
    assert sorted(set(calls)) == [2, 4]


@pytest.mark.parametrize("family", ["deformable_detr", "grounding_dino"])
def test_attention_weights_are_returned_when_asked_for(gen, family):
    """output_attentions=True on the model: the patched modules return transformers' attention weights
    (computed then, and only then), so the model's attention outputs are the same."""
    torch.manual_seed(seed_from(gen))
    model, inputs, _ = MODELS[family](gen)
    model.eval()
    randomize_msda_layers(model, gen)
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True)
        cdt.patch(model)
        patched = model(**inputs, output_attentions=True)
        cdt.unpatch(model)
    fields = [f for f in ("encoder_attentions", "cross_attentions") if expected.get(f) is not None]
    assert fields
    for field in fields:
        want = [t for t in flatten(expected[field]) if t.dim() == 5]  # MSDA weights: (N, Lq, M, L, P)
        got = [t for t in flatten(patched[field]) if t.dim() == 5]
        assert want and len(got) == len(want), field
        for w, g in zip(want, got):
            assert rel_err(g, w) < 1e-6, field


def test_patch_of_a_model_without_msda_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert cdt.patch(model) == 0 and cdt.unpatch(model) == 0
    assert not model._forward_pre_hooks and not model._forward_hooks
    with pytest.raises(TypeError, match="cute_deform: model: expected a torch.nn.Module, got str"):
        cdt.patch("model")


def test_patched_module_under_torch_compile_fullgraph(gen):
    """The patched forward traces into one graph (no graph break: no host sync, no data-dependent
    Python), and gives transformers' output."""
    from transformers.models.deformable_detr import modeling_deformable_detr as detr

    module = build_module(detr.DeformableDetrMultiscaleDeformableAttention, 32, 4, 3, 3).eval()
    randomize_msda_layers(module, gen)
    kwargs = module_inputs(gen, module, 32, [(5, 6), (3, 4), (2, 2)], 4, keep_mask=True)
    with torch.no_grad():
        expected, _ = module(**kwargs)
        cdt.patch(module)
        torch._dynamo.reset()
        out, weights = torch.compile(module, fullgraph=True)(**kwargs)
    assert weights is None and rel_err(out, expected) < TOLERANCE
