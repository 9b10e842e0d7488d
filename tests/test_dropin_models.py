"""The drop-in on Hugging Face transformers models it was not written for, built from tiny configs
(no download): each is routed as the rules say, trains two steps and round-trips its state dict.
Skipped without transformers (``pip install -e '.[models]'``; .ci/run installs it)."""

from __future__ import annotations

import copy

import pytest
import torch

from anvil_fast.optim.dropin import DropInAnvil
from anvil_fast.optim.entry import ANVIL

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
transformers.logging.set_verbosity_error()

V, D = 64, 16


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=D, n_layer=2,
                                                                n_head=2, bos_token_id=0, eos_token_id=0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16))


def _qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=16))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=D, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0))


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=5))


def _text_batch(seed=0):
    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids)


def _t5_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(input_ids=torch.randint(1, V, (2, 8), generator=g), labels=torch.randint(1, V, (2, 5), generator=g))


def _vit_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(pixel_values=torch.randn(2, 3, 8, 8, generator=g), labels=torch.randint(0, 5, (2,), generator=g))


#: model, batch, and what the rules say of some parameters (written from the rules, by hand):
#: "adam" or a bank label prefix; "T" marks a transposed bank.
CASES = {
    "gpt2": (_gpt2, _text_batch, {"transformer.wte.weight": "adam", "transformer.wpe.weight": "adam",
                                  "transformer.h.0.attn.c_attn.weight": "T", "transformer.h.1.mlp.c_proj.weight": "T",
                                  "transformer.h.0.ln_1.weight": "adam"}),
    "llama": (_llama, _text_batch, {"model.embed_tokens.weight": "adam", "lm_head.weight": "adam",
                                    "model.layers.0.self_attn.q_proj.weight": "bank",
                                    "model.layers.1.mlp.down_proj.weight": "bank"}),
    "mixtral": (_mixtral, _text_batch, {"model.layers.0.mlp.experts.gate_up_proj": "bank",
                                        "model.layers.0.mlp.experts.down_proj": "bank",
                                        "model.layers.0.mlp.gate.weight": "bank", "lm_head.weight": "adam"}),
    "qwen2_moe": (_qwen2_moe, _text_batch, {"model.layers.1.mlp.experts.gate_up_proj": "bank",
                                            "model.layers.0.mlp.shared_expert.up_proj.weight": "bank",
                                            "model.embed_tokens.weight": "adam"}),
    "bert": (_bert, _text_batch, {"bert.embeddings.word_embeddings.weight": "adam",
                                  "bert.embeddings.position_embeddings.weight": "adam",
                                  "bert.encoder.layer.0.attention.self.query.weight": "bank"}),
    "t5": (_t5, _t5_batch, {"shared.weight": "adam",
                            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "adam",
                            "decoder.block.1.layer.2.DenseReluDense.wo.weight": "bank"}),
    "vit": (_vit, _vit_batch, {"vit.embeddings.cls_token": "adam", "vit.embeddings.position_embeddings": "adam",
                               "vit.embeddings.patch_embeddings.projection.weight": "adam",
                               "classifier.weight": "adam", "vit.layers.1.mlp.fc1.weight": "bank"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_model_routes_trains_and_round_trips(name):
    make, batch, want = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = ANVIL(model, lr=0.02, adam_lr=0.01)
    losses = []
    for step in range(2):
        out = model(**batch(step))
        out.loss.backward()
        if step == 0:  # routes as planned at construction (the model's dummy_inputs traced)
            routes = {e.name: e for e in opt.plan}
            for pname, kind in want.items():
                e = routes[pname]
                if kind == "adam":
                    assert e.route == "adam", (pname, e.route, e.reason)
                else:
                    assert e.route.startswith("bank_") and e.transposed == (kind == "T"), (pname, e.route, e.reason)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert "observed forward" in opt.describe()
    # a deepcopy continues as the original does (eval mode: no dropout draws)
    model.eval()
    m2, o2 = copy.deepcopy((model, opt))
    for m, o in ((model, opt), (m2, o2)):
        m(**batch(5)).loss.backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m2.parameters()))


def test_gpt2_conv1d_banks_match_the_linear_layout_lr_scale():
    torch.manual_seed(0)
    opt = ANVIL(_gpt2())
    cfgs = opt.inner.param_cfgs
    # c_attn [16, 48] acts as [48, 16]: seed scale sqrt(48 / 16); c_fc [16, 64]: sqrt(4) = 2; c_proj [64, 16]: 1
    assert cfgs["bank_16x48_float32_transposed"].lr_mul == pytest.approx(3 ** 0.5, rel=1e-15)
    assert cfgs["bank_16x64_float32_transposed"].lr_mul == 2.0
    assert cfgs["bank_64x16_float32_transposed"].lr_mul == 1.0
