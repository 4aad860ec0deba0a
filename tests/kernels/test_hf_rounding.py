"""In bf16 the kernels round where transformers does (the models were trained with its roundings):
RMSNorm, the SiLU-gated product and RoPE against transformers' own Llama modules in bf16, equal on
nearly every element. (fp32 rsqrt, sigmoid and cos may differ from torch's by an ulp, which flips a
rounding now and then.) Each test also checks that the single-rounding formula, which the kernels
used before, gives other results, so the comparison can tell the two apart. The kernels run on the GPU
where there is one (compiled), else interpreted; transformers runs on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from mgx.kernels.triton.linear import silu_mul  # noqa: E402
from mgx.kernels.triton.rmsnorm import rms_norm  # noqa: E402
from mgx.kernels.triton.rope import rope_  # noqa: E402

BF16 = torch.bfloat16
AGREE = 0.995  # share of elements equal to transformers' bf16 result
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _agree(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= 2**-7 * want.float().abs() + 1e-30).all()  # never more than one bf16 step apart
    return float((got == want).float().mean())


def test_rmsnorm_rounds_like_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(512, eps=1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(512, generator=g)).to(BF16)
    norm = norm.to(BF16)
    x = (3 * torch.randn(33, 512, generator=g)).to(BF16)
    with torch.no_grad():
        want = norm(x)
    assert _agree(rms_norm(x.to(DEVICE), norm.weight.data.to(DEVICE), 1e-5).cpu(), want) >= AGREE
    xf = x.float()
    single = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()).to(BF16)
    assert float((single != want).float().mean()) > 0.02


def test_silu_mul_rounds_like_transformers() -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = (2 * torch.randn(2, 17, 384, generator=g)).to(BF16)
    want = torch.nn.functional.silu(gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), in bf16
    assert _agree(silu_mul(torch.cat([gate, up], dim=1).to(DEVICE)).cpu(), want) >= AGREE
    single = (torch.nn.functional.silu(gate.float()) * up.float()).to(BF16)
    assert float((single != want).float().mean()) > 0.02


def test_rope_rounds_like_transformers() -> None:
    g = torch.Generator().manual_seed(2)
    config = modeling_llama.LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=4096, rope_theta=500000.0)  # fmt: skip
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    t, d = 29, 128
    positions = torch.randint(0, 4000, (t,), generator=g)
    q = torch.randn(t, 4 * d, generator=g).to(BF16)
    k = torch.randn(t, 2 * d, generator=g).to(BF16)
    cos, sin = rotary(q, positions[None])  # bf16, as the model uses them
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(
        q.view(1, t, 4, d).transpose(1, 2), k.view(1, t, 2, d).transpose(1, 2), cos, sin
    )
    want_q, want_k = want_q.transpose(1, 2).reshape(t, 4 * d), want_k.transpose(1, 2).reshape(t, 2 * d)
    got_q, got_k = rope_(q.clone().to(DEVICE), k.clone().to(DEVICE), positions.to(DEVICE, torch.int32), rotary.inv_freq.to(DEVICE), head_dim=d)
    got_q, got_k = got_q.cpu(), got_k.cpu()
    assert _agree(got_q, want_q) >= AGREE and _agree(got_k, want_k) >= AGREE
    c32, s32 = rotary(q.float(), positions[None])  # fp32 cos/sin and one rounding at the end
    single, _ = modeling_llama.apply_rotary_pos_emb(q.float().view(1, t, 4, d).transpose(1, 2), k.float().view(1, t, 2, d).transpose(1, 2), c32, s32)
    single = single.transpose(1, 2).reshape(t, 4 * d).to(BF16)
    assert float((single != want_q).float().mean()) > 0.02
