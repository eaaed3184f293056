"""diffusers: register_diffusers() makes our backends selectable with diffusers' own
set_attention_backend(...) and attention_backend(...); tiny Flux and Wan transformers built from
configs match diffusers' native backend in float64 under the DESIGN.md rule, forward and backward;
the backend function keeps the native backend's conventions (layout, key padding masks, GQA flag).
diffusers has no public registration API, so register_diffusers() adds enum members and registers
through its private registry: these tests fail the day a diffusers release changes either."""

import copy

import pytest
import torch

import attn_backends as ab
from attn_backends._testing import check_2x

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention_dispatch import (  # noqa: E402
    AttentionBackendName,
    _AttentionBackendRegistry,
    attention_backend,
    dispatch_attention_fn,
)


@pytest.fixture(autouse=True)
def _native_afterwards():
    # set_attention_backend also sets diffusers' process-wide active backend
    yield
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = ab._dispatch.attention

    def counting(*args, **kwargs):
        calls.append(args[3])  # the backend asked for
        return real(*args, **kwargs)

    monkeypatch.setattr(ab._dispatch, "attention", counting)
    return calls


def test_registered_names_are_diffusers_backends():
    names = ab.register_diffusers()
    assert names == ab.register_diffusers()  # idempotent
    assert names["flash"] == "attn_backends_fa" == ab.hf_name("flash") and names["auto"] == "attn_backends"
    values = {m.value for m in AttentionBackendName.__members__.values()}
    for name in names.values():
        assert name in values and AttentionBackendName(name).value == name
        assert _AttentionBackendRegistry._backends[AttentionBackendName(name)].__name__.endswith("_diffusers")
        with attention_backend(name):  # diffusers' own checks accept it
            assert _AttentionBackendRegistry.get_active_backend()[0] == name
    assert AttentionBackendName("native") is AttentionBackendName.NATIVE  # its own members untouched


def _flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(4, 2, 2))

    def inputs(dtype, gen):
        return dict(hidden_states=torch.randn(2, 12, 4, generator=gen).to(dtype),
                    encoder_hidden_states=torch.randn(2, 5, 16, generator=gen).to(dtype),
                    pooled_projections=torch.randn(2, 8, generator=gen).to(dtype),
                    timestep=torch.tensor([0.3, 0.7], dtype=dtype), img_ids=torch.randn(12, 3, generator=gen).to(dtype),
                    txt_ids=torch.zeros(5, 3, dtype=dtype), return_dict=False)

    return model, inputs


def _wan():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)

    def inputs(dtype, gen):
        return dict(hidden_states=torch.randn(2, 4, 2, 4, 4, generator=gen).to(dtype),
                    timestep=torch.tensor([3, 700]), encoder_hidden_states=torch.randn(2, 5, 16, generator=gen).to(dtype),
                    return_dict=False)

    return model, inputs


def _run(model, inputs, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    out = model(**inputs(dtype, gen))[0]
    return out, torch.autograd.grad(out.double().square().sum(), list(model.parameters()))


@pytest.mark.parametrize("select", ["set_attention_backend", "attention_backend"])
@pytest.mark.parametrize("build", [_flux, _wan], ids=["flux", "wan"])
def test_models_match_native_forward_and_backward(build, select, spy):
    names = ab.register_diffusers()
    model, inputs = build()
    ref64 = copy.deepcopy(model).double()
    want, want_grads = _run(ref64, inputs, torch.float64, 1)  # native: what a model starts with
    same, same_grads = _run(model, inputs, torch.float32, 1)
    assert not spy
    ours = copy.deepcopy(model)
    if select == "set_attention_backend":
        ours.set_attention_backend(names["flash"])
        out, grads = _run(ours, inputs, torch.float32, 1)
    else:
        with attention_backend(names["flash"]):
            out, grads = _run(ours, inputs, torch.float32, 1)
    assert spy and set(spy) == {"flash"}
    check_2x("out", out, want, same, 2, torch.float32)
    for (name, _), a, r, s in zip(model.named_parameters(), grads, want_grads, same_grads):
        check_2x(f"d {name}", a, r, s, 3, torch.float32)


def test_backend_function_keeps_native_conventions(gen):
    names = ab.register_diffusers()
    B, S, Sk, H, D = 2, 6, 7, 4, 8
    q = torch.randn(B, S, H, D, generator=gen)  # diffusers' (B, S, H, D)
    k, v = (torch.randn(B, Sk, H, D, generator=gen) for _ in range(2))
    pad = torch.ones(B, Sk, dtype=torch.bool)
    pad[1, 5:] = False  # a key padding mask (B, Sk)
    bias = torch.randn(S, Sk, generator=gen)  # a float mask broadcast as torch's

    def both(**kw):
        theirs = dispatch_attention_fn(q, k, v, backend=AttentionBackendName.NATIVE, **kw)
        ours = dispatch_attention_fn(q, k, v, backend=AttentionBackendName(names["math"]), **kw)
        return ours, theirs

    for kw in (dict(attn_mask=pad), dict(attn_mask=bias), dict(is_causal=True), dict(scale=0.3)):
        ours, theirs = both(**kw)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    fn = _AttentionBackendRegistry._backends[AttentionBackendName(names["math"])]
    out, lse = fn(q, k, v, return_lse=True)
    assert out.shape == (B, S, H, D) and lse.shape == (B, S, H)
    torch.testing.assert_close(lse, torch.logsumexp(torch.einsum("bqhd,bkhd->bqhk", q, k) * D ** -0.5, -1))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fn(q, k[:, :, :2], v[:, :, :2])
    out = fn(q, k[:, :, :2], v[:, :, :2], enable_gqa=True)
    torch.testing.assert_close(out, fn(q, k[:, :, :2].repeat_interleave(2, 2), v[:, :, :2].repeat_interleave(2, 2)))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        fn(q, k, v, _parallel_config=object())
