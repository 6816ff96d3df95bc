"""transformers' Qwen3-Next and Qwen3.5 (gated delta rule), Kimi-Linear (KDA) and Mamba2 (SSD)
layers on attnkit's kernels: the same logits, gradients and generated tokens as transformers' own
torch path (tiny random configs, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
from attnkit.interop import use_attnkit_linear_attention  # noqa: E402


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"], pad_token_id=0)
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).eval()


def qwen3_5():
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=1, linear_num_value_heads=3, layer_types=["linear_attention", "full_attention"],
        pad_token_id=0)
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).eval()


def kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
        linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=None,
        moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return KimiLinearForCausalLM(config).eval()


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8,
                          n_groups=2, expand=2, chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return Mamba2ForCausalLM(config).eval()


MODELS = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "kimi_linear": kimi_linear, "mamba2": mamba2}


def build(name):
    try:
        return MODELS[name]()
    except (ImportError, TypeError, ValueError) as exc:  # a transformers version without this model/config
        pytest.skip(f"{name}: {exc}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_and_gradients_equal_transformers(name, monkeypatch):
    import attnkit.interop.hf_linear_attention as adapter

    calls = []
    real = adapter.gated_linear_attention
    def counting(*a, **kw):
        calls.append(attnkit.explain_gated(*a[:5]).splitlines()[0])
        return real(*a, **kw)

    monkeypatch.setattr(adapter, "gated_linear_attention", counting)
    model = build(name)
    ids = torch.randint(1, 61, (2, 75), generator=torch.Generator().manual_seed(1))  # > one 64-token chunk
    results = []
    for patched in (False, True):
        model.zero_grad()
        with use_attnkit_linear_attention() if patched else torch.enable_grad():
            out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), grads))
    (ref, ref_grads), (got, got_grads) = results
    rule = {"qwen3_next": "gated_delta", "qwen3_5": "gated_delta", "kimi_linear": "kda", "mamba2": "ssd"}[name]
    assert calls and all(c.startswith(f"rule: {rule} ") for c in calls)  # attnkit ran, with the model's rule
    assert (got - ref).abs().max() <= 1e-5
    assert ref_grads.keys() == got_grads.keys() and ref_grads
    largest = max(g.abs().max() for g in ref_grads.values())
    for n in ref_grads:  # relative per parameter, floored at the largest gradient's rounding (near-zero grads)
        scale = torch.maximum(ref_grads[n].abs().max(), 1e-3 * largest)
        assert ((got_grads[n] - ref_grads[n]).abs().max() / scale) <= 1e-4, n


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_equals_transformers(name):
    model = build(name)
    ids = torch.randint(1, 61, (1, 13), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kwargs)
    with use_attnkit_linear_attention() as patched:
        got = model.generate(ids, **kwargs)
    assert patched
    assert torch.equal(got.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, ref.scores)) <= 1e-5


def test_patch_is_undone_after_the_block():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    original = m.torch_chunk_gated_delta_rule
    with pytest.raises(RuntimeError):
        with use_attnkit_linear_attention():
            assert m.torch_chunk_gated_delta_rule is not original
            raise RuntimeError("inside")
    assert m.torch_chunk_gated_delta_rule is original
