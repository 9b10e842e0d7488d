"""anvil_fast.optim.roles and the drop-in's routing by what each parameter does (vision models built here
from plain torch modules in the layouts of torchvision and timm; a GPT-2 block with transformers'
Conv1D layout; the package's own GPT, whose routing is pinned)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from anvil_fast.models import gpt
from anvil_fast.optim.dropin import DropInAnvil
from anvil_fast.optim.entry import ANVIL
from anvil_ref.config import ConfigError
from anvil_ref.equalizer import lane_energy_shape, reduction_axis
from anvil_ref.update import shape_lr_multiplier


def _seeded(cls, *args, seed=0, **kw):
    torch.manual_seed(seed)  # nn's initializers draw from the global generator: fixed here
    return cls(*args, **kw)


def _images(seed=0, n=4, c=3, hw=8):
    return torch.randn(n, c, hw, hw, generator=torch.Generator().manual_seed(seed))


def _routes(opt):
    return {e.name: (e.route, e.reason) for e in opt.plan}


def _adam(opt):
    return {e.name for e in opt.plan if e.route == "adam"}


# ------------------------------------------------------------------ models
class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetLike(nn.Module):
    """torchvision's resnet layout: stem ``conv1``, ``layer1``, ``fc`` (a name no head list has)."""

    def __init__(self, classes=10, c=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(h.mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(a.transpose(1, 2).reshape(b, n, d))


class VitBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class PatchEmbed(nn.Module):
    def __init__(self, d, patch=4):
        super().__init__()
        self.proj = nn.Conv2d(3, d, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class VitLike(nn.Module):
    """timm's vision transformer layout: ``patch_embed.proj``, ``cls_token [1, 1, D]``,
    ``pos_embed [1, N + 1, D]`` (plain Parameters), blocks, ``head.fc``."""

    def __init__(self, d=16, classes=5, hw=8, patch=4, depth=2):
        super().__init__()
        self.patch_embed = PatchEmbed(d, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (hw // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[VitBlock(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Module()
        self.head.fc = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head.fc(self.norm(self.blocks(x))[:, 0])


class TableNet(nn.Module):
    """Plain 2-D Parameters doing three things: a position table added to tokens (``pos [N, D]``),
    a relative-bias table indexed by a buffer then added to scores (Swin's layout), and a weight
    used as ``x @ W`` (``[in, out]``)."""

    def __init__(self, n=6, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.pos = nn.Parameter(torch.randn(n, d) * 0.1)
        self.bias_table = nn.Parameter(torch.randn(2 * n - 1, 1) * 0.1)
        idx = torch.arange(n)
        self.register_buffer("rel_index", (idx[:, None] - idx[None, :] + n - 1).view(-1))
        self.w = nn.Parameter(torch.randn(d, 2 * d) * 0.1)
        self.w2 = nn.Parameter(torch.randn(2 * d, d) * 0.1)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x) + self.pos
        bias = self.bias_table[self.rel_index].view(h.shape[1], h.shape[1])
        h = torch.softmax(h @ h.transpose(1, 2) + bias, -1) @ h
        h = h + torch.relu(h @ self.w) @ self.w2
        return self.out(h.mean(1))


class Conv1D(nn.Module):
    """transformers' Conv1D layout (``weight [in, out]``, ``y = x @ W + b``), written here."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class Gpt2Mlp(nn.Module):
    def __init__(self, d=8, linear=False):
        super().__init__()
        make = (lambda i, o: nn.Linear(i, o)) if linear else (lambda i, o: Conv1D(o, i))
        self.emb = nn.Embedding(20, d)
        self.c_attn, self.c_proj, self.c_fc, self.c_out = make(d, 3 * d), make(d, d), make(d, 4 * d), make(4 * d, d)
        self.lm_head = nn.Linear(d, 20, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        q, k, v = self.c_attn(h).chunk(3, -1)
        h = h + self.c_proj(torch.softmax(q @ k.transpose(1, 2), -1) @ v)
        return self.lm_head(h + self.c_out(torch.relu(self.c_fc(h))))


# ------------------------------------------------------------------ roles (the observation itself)
def test_observe_sees_tables_products_orientation_and_io_layers():
    from anvil_fast.optim.roles import observe

    m = _seeded(TableNet)
    obs = observe(m, torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)), list(m.parameters()))
    assert obs.complete
    assert obs.role(m.pos) == "elementwise" and obs.first_call(m.pos, "elementwise") == "add"
    assert obs.role(m.bias_table) == "elementwise"  # indexed by a buffer (static), then added to scores
    assert obs.role(m.w) == obs.role(m.w2) == "matrix"
    assert obs.orientation(m.w) is True and obs.orientation(m.inp.weight) is False  # x @ W: [in, out]
    assert id(m.inp.weight) in obs.input_layers and id(m.out.weight) in obs.output_layers
    assert id(m.w) not in obs.input_layers | obs.output_layers


def test_observe_changes_nothing():
    from anvil_fast.optim.roles import observe

    m = _seeded(ResNetLike)
    m.train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = torch.get_rng_state()
    observe(m, _images(), list(m.parameters()))
    assert torch.equal(torch.get_rng_state(), g) and m.training and m.layer1[0].training
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # batch-norm statistics too


# ------------------------------------------------------------------ 1: tokens and position tables
def test_tokens_and_position_tables_go_to_adam():
    m = _seeded(VitLike)
    with pytest.warns(UserWarning, match="could not be traced .*pass example_input=") as got:
        opt = ANVIL(m)  # nothing to trace: the fallback reads a leading dimension of 1 as a broadcast table
    assert sum("example_input=" in str(w.message) for w in got) == 1  # warned once
    assert got[0].filename == __file__  # at the caller's line
    r = _routes(opt)
    assert r["cls_token"][0] == r["pos_embed"][0] == "adam"
    assert "broadcast table" in r["pos_embed"][1]
    m(_images()).sum().backward()  # a forward changes nothing: the plan was fixed at construction
    assert _routes(opt) == r
    opt = ANVIL(_seeded(VitLike), example_input=_images())
    r = _routes(opt)
    assert r["cls_token"] == ("adam", "observed: combined with activations by cat")
    assert r["pos_embed"] == ("adam", "observed: combined with activations by add")
    opt.step()


def test_a_two_dim_position_table_and_an_indexed_table_go_to_adam_once_traced():
    m = _seeded(TableNet)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    opt = ANVIL(m, example_input=x)
    r = _routes(opt)
    assert r["pos"][0] == r["bias_table"][0] == "adam"
    assert r["w"][0].startswith("bank_") and "transposed" in r["w"][1]


# ------------------------------------------------------------------ 2, 3: output and input layers
def test_resnet_fc_and_stem_are_found_by_what_they_do():
    m = _seeded(ResNetLike)
    opt = ANVIL(m, example_input=_images())
    r = _routes(opt)
    assert r["fc.weight"] == ("adam", "output layer (observed: its product is a model output)")
    assert r["conv1.weight"] == ("adam", "input layer (observed: applied to the model's input)")
    assert {n for ns in opt.banks.values() for n in ns} == {f"layer1.{i}.conv{j}.weight" for i in (0, 1)
                                                           for j in (1, 2)}


def test_the_plan_is_fixed_at_construction_and_no_hook_stays_on_the_model():
    m = _seeded(ResNetLike)
    with pytest.warns(UserWarning, match="example_input="):
        opt = ANVIL(m)  # nothing to trace: fc banked by the fallback, for good
    plan = [(e.name, e.route, e.slots) for e in opt.plan]
    groups = [len(g["params"]) for g in opt.param_groups]
    assert _routes(opt)["fc.weight"][0].startswith("bank_")
    assert "not observed" in opt.describe() and "example_input=" in opt.describe()
    for mod in m.modules():
        assert not (mod._forward_hooks or mod._forward_pre_hooks), mod
    nn.functional.cross_entropy(m(_images()), torch.arange(4)).backward()
    before = m.layer1[0].conv1.weight.detach().clone()
    opt.step()
    assert [(e.name, e.route, e.slots) for e in opt.plan] == plan
    assert [len(g["params"]) for g in opt.param_groups] == groups
    assert not torch.equal(before, m.layer1[0].conv1.weight)  # the banks are the model's weights


def test_vit_patch_embedding_and_head_fc():
    m = _seeded(VitLike)
    opt = ANVIL(m, example_input=_images())
    r = _routes(opt)
    assert r["patch_embed.proj.weight"][0] == r["head.fc.weight"][0] == "adam"
    assert "input layer" in r["patch_embed.proj.weight"][1]


def test_io_layers_anvil_banks_them():
    m = _seeded(ResNetLike)
    opt = ANVIL(m, example_input=_images(), io_layers="anvil")
    r = _routes(opt)
    assert r["conv1.weight"][0].startswith("bank_") and r["fc.weight"][0].startswith("bank_")
    with pytest.raises(ValueError, match="io_layers must be one of"):
        ANVIL(_seeded(ResNetLike), io_layers="none")


def test_a_compiled_model_is_traced_through_its_original_module():
    x = _images()
    ref = ANVIL(_seeded(ResNetLike), example_input=x)
    for compiled in (torch.compile(_seeded(ResNetLike), backend="aot_eager"),):
        opt = ANVIL(compiled, example_input=x)
        assert _routes(opt) == _routes(ref)
        assert _routes(opt)["fc.weight"][0] == "adam" and "observed forward (example_input)" in opt.describe()
        nn.functional.cross_entropy(compiled(x), torch.arange(4)).backward()
        opt.step()
    # a compiled submodule runs eagerly for the trace (nothing compiled there)
    m = _seeded(ResNetLike)
    m.layer1 = torch.compile(m.layer1, backend="aot_eager")
    opt = ANVIL(m, example_input=x)
    assert {e.name: e.route for e in opt.plan} == {e.name.replace("layer1.", "layer1.", 1): e.route for e in ref.plan}
    # without example_input, what the original module offers is traced (an nn.Sequential of nn.Linear)
    seq = _seeded(nn.Sequential, nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = ANVIL(torch.compile(seq, backend="aot_eager"))
    r = _routes(opt)
    assert r["0.weight"][0] == r["4.weight"][0] == "adam" and r["2.weight"][0].startswith("bank_")


def test_compiling_after_construction_leaves_the_compiled_forward_alone():
    m = _seeded(ResNetLike)
    opt = ANVIL(m, example_input=_images())
    plan = _routes(opt)
    compiled = torch.compile(m, backend="aot_eager")
    for _ in range(2):
        nn.functional.cross_entropy(compiled(_images()), torch.arange(4)).backward()
        opt.step()
        opt.zero_grad()
    assert _routes(opt) == plan


# ------------------------------------------------------------------ 4: parameters without the model
@pytest.mark.parametrize("how", ["parameters", "named_parameters"])
def test_parameters_of_a_model_route_like_the_model(how):
    m = _seeded(Gpt2Mlp, linear=True)
    ref = ANVIL(_seeded(Gpt2Mlp, linear=True))
    opt = ANVIL(getattr(m, how)())
    names = [n for n, _ in m.named_parameters()]
    want = {e.name: e.route for e in ref.plan}
    got = {e.name: e.route for e in opt.plan}
    if how == "parameters":
        got = {names[int(k[len("param"):])]: v for k, v in got.items()}
    assert got == want
    assert want["emb.weight"] == want["lm_head.weight"] == "adam"


def test_parameters_of_no_module_warn():
    ps = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]
    with pytest.warns(UserWarning, match="without their model"):
        ANVIL(ps)


# ------------------------------------------------------------------ 5: [in, out] weights
def test_conv1d_weights_are_banked_transposed_with_linear_lr_scale():
    conv, lin = _seeded(Gpt2Mlp), _seeded(Gpt2Mlp, linear=True)
    oc, ol = ANVIL(conv), ANVIL(lin)
    e = {x.name: x for x in oc.plan}
    assert e["c_fc.weight"].transposed and e["c_fc.weight"].route == "bank_8x32_float32_transposed"
    assert not {x.name: x for x in ol.plan}["c_fc.weight"].transposed
    for name in ("c_attn.weight", "c_fc.weight", "c_out.weight", "c_proj.weight"):
        lc = next(b for b, ns in oc.banks.items() if name in ns)
        ll = next(b for b, ns in ol.banks.items() if name in ns)
        assert oc.inner.param_cfgs[lc].lr_mul == ol.inner.param_cfgs[ll].lr_mul, name
    # by hand: c_fc is [8, 32] stored, [32, 8] as a layer: seed scale sqrt(32 / 8) = 2
    assert oc.inner.param_cfgs["bank_8x32_float32_transposed"].lr_mul == 2.0
    assert shape_lr_multiplier(8, 32) == 1.0  # what the stored shape alone would give


def test_split_rows_on_an_in_out_weight_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="c_attn.weight is stored \\[in, out\\].*Leave it unsplit"):
        ANVIL(_seeded(Gpt2Mlp), split_rows={"c_attn.weight": 3})


def test_square_transposed_bank_reduces_over_the_linear_layout_axis():
    opt = ANVIL(_seeded(Gpt2Mlp))
    label = "bank_8x8_float32_transposed"  # c_proj: square, where the stored shape's rule differs
    bank = opt.inner.banks[label]
    chunk_shape = tuple(bank.p_slice.shape)
    assert opt.inner.param_cfgs[label].transposed
    assert bank.red_dim == reduction_axis(chunk_shape, transposed=True) == -2
    assert tuple(bank.lane_energy.shape) == lane_energy_shape(chunk_shape, transposed=True)
    assert tuple(opt.inner.param_states[label]["lane_energy"].shape) == lane_energy_shape(chunk_shape,
                                                                                         transposed=True)


def test_transposed_banks_train():
    m = _seeded(Gpt2Mlp)
    opt = ANVIL(m)
    ids = torch.randint(0, 20, (4, 7), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------ 6: frozen and shared parameters
def test_a_parameter_unfrozen_later_raises_at_the_step_or_trains_with_frozen_include():
    m = _seeded(ResNetLike)
    for p in m.layer1[1].parameters():
        p.requires_grad_(False)
    opt = ANVIL(m, example_input=_images())
    for p in m.layer1[1].parameters():
        p.requires_grad_(True)
    nn.functional.cross_entropy(m(_images()), torch.arange(4)).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match="layer1.1.conv1.weight was frozen.*frozen='include'"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))  # nothing was updated
    m = _seeded(ResNetLike)
    for p in m.layer1[1].parameters():
        p.requires_grad_(False)
    opt = ANVIL(m, example_input=_images(), frozen="include")
    assert "layer1.1.conv1.weight" in {n for ns in opt.banks.values() for n in ns}
    for p in m.layer1[1].parameters():
        p.requires_grad_(True)
    w = m.layer1[1].conv1.weight.detach().clone()
    nn.functional.cross_entropy(m(_images()), torch.arange(4)).backward()
    opt.step()
    assert not torch.equal(w, m.layer1[1].conv1.weight)


def test_two_parameters_over_one_memory_are_refused():
    m = _seeded(Gpt2Mlp, linear=True)
    m.c_fc.weight = nn.Parameter(m.c_proj.weight.data.repeat(4, 1))
    m.extra = nn.Parameter(m.c_attn.weight.data[:8])  # a second Parameter over c_attn's memory
    with pytest.raises(ConfigError, match="(extra and c_attn.weight|c_attn.weight and extra) are two Parameters over one memory"):
        ANVIL(m)


# ------------------------------------------------------------------ the package's GPT routes as before
def _gpt_plan(opt):
    return opt.banks, dict(opt.adam_names), {e.name: e.reason for e in opt.plan}


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_package_gpt_routes_are_pinned(size):
    """Written out by hand from the routing the package's training results were made with: every
    hidden matrix banked by shape in layer order, embeddings, head and vectors on Adam."""
    m = gpt.build(size)
    L, d = m.cfg.n_layer, m.cfg.n_embd
    want_banks = {f"bank_{3 * d}x{d}_float32": [f"blocks.{i}.attn.qkv.weight" for i in range(L)],
                  f"bank_{d}x{d}_float32": [f"blocks.{i}.attn.proj.weight" for i in range(L)],
                  f"bank_{4 * d}x{d}_float32": [f"blocks.{i}.mlp.fc.weight" for i in range(L)],
                  f"bank_{d}x{4 * d}_float32": [f"blocks.{i}.mlp.proj.weight" for i in range(L)]}
    x = torch.randint(0, m.cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    for opt in (ANVIL(m), ANVIL(gpt.build(size), example_input=(x[:, :-1], x[:, 1:]))):
        banks, adam, reasons = _gpt_plan(opt)
        assert banks == want_banks
        assert set(adam) == {n for n, _ in m.named_parameters()} - {n for ns in want_banks.values() for n in ns}
        assert reasons["wte.weight"] == reasons["wpe.weight"] == "embedding"
        assert reasons["lm_head.weight"] == "output head"
    assert "observed forward (the model's dummy_inputs)" in ANVIL(gpt.build(size)).describe()


def test_expert_stack_orientation_is_read_off_the_product():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.inp = nn.Linear(8, 8)
            self.w_in = nn.Parameter(torch.randn(4, 12, 8, generator=g) * 0.3)   # read as [out, in]
            self.w_out = nn.Parameter(torch.randn(4, 12, 8, generator=g) * 0.3)  # bmm(h, w): [in, out]
            self.out = nn.Linear(8, 2)

        def forward(self, x):  # x [4, n, 8]
            h = torch.relu(torch.einsum("eni,eoi->eno", self.inp(x), self.w_in))
            return self.out(torch.bmm(h, self.w_out))

    m = Experts()
    opt = ANVIL(m, example_input=torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(4)))
    e = {x.name: x for x in opt.plan}
    assert not e["w_in"].transposed and e["w_in"].route == "bank_12x8_float32"
    assert e["w_out"].transposed and e["w_out"].route == "bank_12x8_float32_transposed"
    assert "stack (observed: matrix operand of einsum" in e["w_in"].reason


@pytest.mark.parametrize("conv", [nn.Conv1d(3, 8, 5, dilation=2), nn.Conv2d(4, 8, 1, stride=2),
                                  nn.Conv3d(2, 8, (3, 1, 2), padding=(1, 0, 0))], ids=["1d", "2d", "3d"])
def test_sequential_starting_with_a_convolution_is_traced(conv):
    """An ``nn.Sequential`` whose first module is a convolution is traced at construction on one
    smallest image of its input: the first convolution is the input layer and the last the output
    layer (Adam), the one between is banked; no warning about an untraced model."""
    d = conv.weight.ndim - 2
    C, BN = {1: (nn.Conv1d, nn.BatchNorm1d), 2: (nn.Conv2d, nn.BatchNorm2d), 3: (nn.Conv3d, nn.BatchNorm3d)}[d]
    m = nn.Sequential(conv, BN(8), nn.ReLU(), C(8, 8, 1), nn.ReLU(), C(8, 2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = ANVIL(m)
    routes = {e.name: e for e in opt.plan}
    assert routes["0.weight"].route == "adam" and "input layer" in routes["0.weight"].reason
    assert routes["5.weight"].route == "adam" and "output layer" in routes["5.weight"].reason
    assert routes["3.weight"].route != "adam"
    assert "one smallest image of the first convolution's input" in opt.describe()
