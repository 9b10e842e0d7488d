"""The drop-in ``anvil_fast.ANVIL`` against anvil_ref/dropin.py, a float64 reference built from
the user's arguments alone (never from the optimizer under test).

Every hyperparameter has a non-default value; every param-group value changes mid-run; the gradients
are fixed, seeded sequences set on ``.grad`` (no training feedback, so errors do not compound through
the model). Matrix gradients are well conditioned (condition number at most ~13,
a per-step row scaling so the lane energies move) and bf16-representable (an fp32 bank's gradient
travels in bf16, which is then exact). Tolerances: anvil_fast/core/tolerances.py, section "drop-in".
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from anvil_fast.studies.difftest import rel_err
from anvil_fast.optim.dropin import DropInAnvil
from anvil_fast.optim.entry import ANVIL
from anvil_fast.parallel.distributed import leave_rank
from tests import optimizer_cases as C
from anvil_fast.core import tolerances as TOL
from anvil_ref.dropin import SPEC_HEAD_NAMES, DropinReference, route_parameters


#: Non-default values for every hyperparameter (defaults: lr 0.023, adam_lr 0.008, momentum 0.95,
#: fast_beta None, fast_weight 1, beta2 0.9, weight_decay 2.25, betas (0.9, 0.95), eps 1e-10, Adam
#: decay 0.005). Adam's decay and lr are large enough that the decay moves a weight by
#: adam_lr**2 * adam_weight_decay = 1.2e-4 of itself per step, far above fp32 rounding (tolerances).
KW = dict(lr=0.031, adam_lr=0.02, momentum=0.9, fast_beta=0.7, fast_weight=0.6, beta2=0.8, weight_decay=1.5,
          adam_betas=(0.8, 0.9), adam_eps=1e-8, adam_weight_decay=0.3)
#: The values every param-group key takes before step CHANGE_AT.
CHANGED = {"anvil": dict(lr=0.017, momentum=0.8, fast_beta=0.5, fast_weight=0.3, beta2=0.5, weight_decay=3.0),
           "adam": dict(lr=0.025, betas=(0.6, 0.8), eps=1e-6, weight_decay=0.5)}
STEPS, CHANGE_AT = 6, 3


class Zoo(nn.Module):
    """Every parameter kind the drop-in routes today: linear matrices (square, tall, wide), an
    embedding, a head tied to it by identity under a name that is no head name, a named head,
    LayerNorm, biases, a scalar."""

    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, 3 * d)
        self.fc2 = nn.Linear(3 * d, d)
        self.ln = nn.LayerNorm(d)
        self.gain = nn.Parameter(torch.ones(()))
        self.proj_out = nn.Linear(d, vocab, bias=False)
        self.proj_out.weight = self.emb.weight  # tied: caught by identity, not by name
        self.head = nn.Linear(d, 24, bias=False)


class ZooPlus(Zoo):
    """Zoo and the kinds the specification adds: a convolution, a 3-D stack, a fused qkv split."""

    def __init__(self, vocab=40, d=16):
        super().__init__(vocab, d)
        self.conv = nn.Conv1d(4, 8, 3)
        self.experts = nn.Parameter(torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(5)) * 0.2)
        self.qkv = nn.Linear(d, 3 * d, bias=False)


class Conv1D(nn.Module):
    """transformers' Conv1D layout (weight [in, out], y = x @ W + b), by its class name."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf, generator=torch.Generator().manual_seed(nf + nx)) * 0.2)
        self.bias = nn.Parameter(torch.zeros(nf))


class ZooT(Zoo):
    """Zoo and two weights stored [in, out]: wide as stored (tall as a layer) and tall as stored."""

    def __init__(self, vocab=40, d=16):
        super().__init__(vocab, d)
        self.c_fc = Conv1D(3 * d, d)  # [16, 48]
        self.c_out = Conv1D(d, 3 * d)  # [48, 16]


class ZooTSquare(Zoo):
    def __init__(self, vocab=40, d=16):
        super().__init__(vocab, d)
        self.c_proj = Conv1D(d, d)  # [16, 16]: the stored shape's reduction axis is not the layer's


def make_model(cls=Zoo, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)  # nn's initializers draw from the global generator; fixed here
    return cls().to(dtype)


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def well_conditioned(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """A random matrix with singular values in [0.5, 1]."""
    a = torch.linalg.qr(torch.randn(max(rows, cols), max(rows, cols), generator=g, dtype=torch.float64))[0]
    b = torch.linalg.qr(torch.randn(min(rows, cols), min(rows, cols), generator=g, dtype=torch.float64))[0]
    s = torch.linspace(1.0, 0.5, min(rows, cols), dtype=torch.float64)
    m = a[:, :min(rows, cols)] * s @ b
    return m if rows >= cols else m.T


def gradient_sequence(routes, steps: int, seed: int = 11) -> list[dict[str, torch.Tensor]]:
    """``steps`` gradients per parameter (float32, bf16-representable). Matrices: a fixed
    well-conditioned base plus a quarter of a fresh one, rows scaled by a per-step factor in [0.7, 1.4]
    (condition number <= 4 * 2 * 1.67); others: Gaussian, with an embedding's first 10 rows zero
    (rows no token reached: Adam's update there is exactly zero)."""
    g = torch.Generator().manual_seed(seed)
    base = {}
    out = []
    for t in range(steps):
        grads = {}
        for r in routes:
            if r.kind == "matrix":
                n, rows, cols = r.stack
                if r.name not in base:
                    base[r.name] = torch.stack([well_conditioned(rows, cols, g) for _ in range(n)])
                fresh = torch.stack([well_conditioned(rows, cols, g) for _ in range(n)])
                scale = 0.7 * 2.0 ** torch.rand(n, rows, 1, generator=g, dtype=torch.float64)
                x = (base[r.name] + 0.25 * fresh) * scale * 0.05
                grads[r.name] = _bf16_exact(x.float().reshape(r.shape))
            else:
                x = torch.randn(r.shape, generator=g) * 0.1
                if r.reason == "embedding":
                    x[:10] = 0
                grads[r.name] = _bf16_exact(x)
        out.append(grads)
    return out


def ulp32(x: np.ndarray) -> np.ndarray:
    return C.ulp(x, 23)


class AdamBound:
    """Elementwise bound on |fast - reference| of an fp32 Adam parameter over a run, from the
    per-step ulp budgets of anvil_fast/core/tolerances.py: the moments' errors accumulate through their EMAs
    (each step adds ADAM_MOMENT_ULPS ulps of the larger input), enter the update scaled by
    step_size / (sqrt(v') + eps) (m) and |u| / (2 v') (v, through the square root), and each step adds
    ADAM_ULPS ulps of the largest term (C.adam_terms) to the parameter's error."""

    def __init__(self, shape):
        self.e_m, self.e_v, self.e_p = np.zeros(shape), np.zeros(shape), np.zeros(shape)

    def step(self, p, g, m, v, *, step, lr, betas, eps, weight_decay, bf16=False):
        b1, b2 = betas
        self.e_m = b1 * self.e_m + TOL.ADAM_MOMENT_ULPS * ulp32(np.maximum(np.abs(m), np.abs(g)))
        self.e_v = b2 * self.e_v + TOL.ADAM_MOMENT_ULPS * ulp32(np.maximum(v, g * g))
        ss = lr * np.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        m_new, v_new = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        den = np.sqrt(v_new) + eps
        u = ss * m_new / den
        from_v = np.divide(np.abs(u) * self.e_v, 2 * v_new, out=np.zeros_like(v_new), where=v_new > 0)
        cfg = type("cfg", (), dict(adam_betas=betas, lr=lr, lr_mul=1.0, eps=eps, weight_decay=weight_decay,
                                   wd_mul=1.0))
        terms = C.adam_terms(cfg, p, g, m, v, step)
        self.e_p = self.e_p * (1 + lr * lr * weight_decay) + TOL.ADAM_ULPS * ulp32(terms) + ss * self.e_m / den \
            + from_v
        if bf16:  # both sides store the step rounded to bf16: 0.5 bf16 ulp each
            self.e_p = self.e_p + TOL.ADAM_BF16_ULPS * C.ulp(terms, 7)
        return self.e_p


class RailBound:
    """Elementwise bound on an fp32 rail against float64: each EMA step adds RAILS_ULPS ulps of the
    larger of its inputs and its result (anvil_fast/core/tolerances.py) and carries the old error at most 1x."""

    def __init__(self, shape):
        self.e = np.zeros(shape)

    def step(self, v_old, g, v_new):
        self.e = self.e + TOL.RAILS_ULPS * ulp32(np.maximum.reduce([np.abs(v_old), np.abs(g), np.abs(v_new)]))
        return self.e


# ------------------------------------------------------------------ reading the optimizer's results
def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def fast_matrix_state(opt, model, name: str) -> dict[str, np.ndarray]:
    """A matrix's fast rail, slow rail, lane energy and exact fp32 master (float64; the rails in its
    stack shape [n, rows, cols]). The specification's per-parameter view ``opt.state[p]`` where the
    drop-in has it, else the bank's slice through ``opt.inner``. The master of a bf16 matrix is the
    parameter joined with its mantissa; an fp32 matrix is its own master."""
    from anvil_ref.storage import join_fp32

    p = _params(model)[name]
    st = opt.state.get(p) if hasattr(opt, "state") else None
    if st and "fast_rail" in st:
        out = {k: st[k].double().cpu().numpy() for k in ("fast_rail", "slow_rail", "lane_energy")}
        mantissa = st.get("mantissa")
    else:
        label, i = next((l, ns.index(name)) for l, ns in opt.banks.items() if name in ns)
        ps = opt.inner.param_states[label]
        vel = ps["velocity"].double()
        out = dict(fast_rail=vel[0, i:i + 1].numpy(), slow_rail=vel[1, i:i + 1].numpy(),
                   lane_energy=ps["lane_energy"][i:i + 1].double().numpy())
        mantissa = ps.get("mantissa")
        mantissa = None if mantissa is None else mantissa[i]
    if p.dtype == torch.bfloat16:
        out["master"] = join_fp32(p.detach().cpu().reshape(mantissa.shape), mantissa.cpu()).double().numpy()
    else:
        out["master"] = p.detach().double().cpu().numpy()
    return out


def _values(opt, model, ref) -> dict[str, np.ndarray]:
    """Every parameter's value as float64 (a matrix: its exact fp32 master)."""
    out = {n: p.detach().double().numpy().copy() for n, p in _params(model).items()}
    for r in ref.routes:
        if r.kind == "matrix":
            out[r.name] = fast_matrix_state(opt, model, r.name)["master"].reshape(r.shape)
    return out


def set_group(opt, ref, kind: str, key: str, value) -> None:
    group = next(g for g in opt.param_groups if g["kind"] == kind)
    group[key] = value
    ref.groups[kind][key] = value


def run_pair(model_cls=Zoo, *, kw=KW, steps=STEPS, change_at=CHANGE_AT, no_grad: dict[int, set] | None = None,
             ref_kw=None, opt_kw=None, dtype=torch.float32, eager=False):
    """The drop-in and the reference on the same model and gradients, step by step. Yields, after
    each step t, (t, model, opt, ref, grads_t, before) where ``before`` holds the values before it."""
    model = make_model(model_cls, dtype=dtype)
    ref = DropinReference(model, **kw, **(ref_kw or {}))
    opt = ANVIL(model, **kw, **(opt_kw or {}), bank_config="faithful", compile=False)
    twin = None
    if eager:
        model_e = make_model(model_cls, dtype=dtype)
        twin = (model_e, ANVIL(model_e, **kw, **(opt_kw or {}), bank_config="faithful", compile=False))
        twin[1].inner.bank_update = C.eager_bank_update
    seq = gradient_sequence(ref.routes, steps)
    for t in range(steps):
        if t == change_at:
            for kind, vals in CHANGED.items():
                for k, v in vals.items():
                    set_group(opt, ref, kind, k, v)
                    if twin:
                        next(g for g in twin[1].param_groups if g["kind"] == kind)[k] = v
        skip = (no_grad or {}).get(t, set())
        grads = {n: (None if n in skip else g) for n, g in seq[t].items()}
        before = _values(opt, model, ref)
        twin_before = _values(twin[1], twin[0], ref) if twin else {}
        for mdl in [model] + ([twin[0]] if twin else []):
            for n, p in _params(mdl).items():
                p.grad = None if grads.get(n) is None else grads[n].to(p.dtype).clone()
        ref_before = {r.name: ref.value(r.name).copy() for r in ref.routes}
        ref_state_before = copy.deepcopy(ref.state)
        opt.step()
        if twin:
            twin[1].step()
        ref.step(grads)
        yield dict(t=t, model=model, opt=opt, ref=ref, grads=grads, before=before, ref_before=ref_before,
                   ref_state_before=ref_state_before, twin=twin, twin_before=twin_before)


def check_run(model_cls=Zoo, *, kw=KW, no_grad=None, ref_kw=None, opt_kw=None, steps=STEPS, eager=True,
              dtype=torch.float32):
    """All assertions of a run: Adam elementwise within AdamBound; matrices' rails within RailBound,
    lane energies and weight steps within the drop-in rows of anvil_fast/core/tolerances.py, and (with the
    eager twin) the bf16 rule against the eager-bf16 bank update."""
    bounds, rail_bounds = {}, {}
    worst = {}
    for st in run_pair(model_cls, kw=kw, no_grad=no_grad, ref_kw=ref_kw, opt_kw=opt_kw, steps=steps,
                       eager=eager, dtype=dtype):
        ref, model, opt, t = st["ref"], st["model"], st["opt"], st["t"]
        params = _params(model)
        for r in ref.routes:
            fast = params[r.name].detach().double().numpy()
            want = ref.value(r.name)
            g = st["grads"].get(r.name)
            if r.kind == "adam":
                if r.name not in bounds:
                    bounds[r.name] = AdamBound(r.shape)
                b = bounds[r.name]
                if g is not None:
                    s0 = st["ref_state_before"][r.name]
                    hp = ref.groups["adam"]
                    b.step(st["ref_before"][r.name], g.double().numpy(), s0["exp_avg"], s0["exp_avg_sq"],
                           step=ref.state[r.name]["step"], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                           weight_decay=hp["weight_decay"], bf16=params[r.name].dtype == torch.bfloat16)
                if g is None:  # untouched, bit for bit (and its step count holds: the bound's next steps)
                    assert np.array_equal(fast, st["before"][r.name]), (t, r.name)
                err = np.abs(fast - want)
                assert (err <= b.e_p).all(), (t, r.name, float((err - b.e_p).max()), float(err.max()))
                worst[r.name] = max(worst.get(r.name, 0.0), float((err / np.maximum(b.e_p, 1e-300)).max()))
                continue
            # matrices: rails (fp32 EMAs of exact gradients)
            fs = fast_matrix_state(opt, model, r.name)
            fast = fs["master"].reshape(fast.shape)
            s0, s1 = st["ref_state_before"][r.name], ref.state[r.name]
            gm = np.zeros(r.stack) if g is None else g.double().numpy().reshape(r.stack)
            for key in ("fast_rail", "slow_rail"):
                rb = rail_bounds.setdefault((r.name, key), RailBound(r.stack))
                if g is not None:
                    rb.step(s0[key], gm, s1[key])
                err = np.abs(fs[key] - s1[key])
                assert (err <= rb.e).all(), (t, r.name, key, float(err.max()), float(rb.e.max()))
            assert fs["lane_energy"].shape[-2:] == s1["lane_energy"].shape[-2:], (t, r.name)  # the same lanes
            e_energy = float(np.max(np.abs(fs["lane_energy"] - s1["lane_energy"]) /
                                    np.maximum(s1["lane_energy"], 1e-30)))
            assert e_energy <= TOL.DROPIN_LANE_ENERGY_REL, (t, r.name, e_energy)
            worst[("energy", r.name)] = max(worst.get(("energy", r.name), 0.0), e_energy)
            d_fast = torch.from_numpy((fast - st["before"][r.name]).reshape(r.stack))
            d_ref = torch.from_numpy((want - st["ref_before"][r.name]).reshape(r.stack))
            e = rel_err(d_fast, d_ref)
            worst[r.name] = max(worst.get(r.name, 0.0), e)
            assert e <= TOL.DROPIN_STEP_REL, (t, r.name, e)
            if g is not None and st["twin"] is not None:
                twin_master = fast_matrix_state(st["twin"][1], st["twin"][0], r.name)["master"]
                d_eager = twin_master.reshape(r.shape) - st["twin_before"][r.name]
                e_eager = rel_err(torch.from_numpy(d_eager.reshape(r.stack)), d_ref)
                worst[("eager", r.name)] = max(worst.get(("eager", r.name), 0.0), e_eager)
                assert e <= TOL.bf16_bound(e_eager), (t, r.name, e, e_eager)
                assert e_eager <= TOL.DROPIN_STEP_REL, (t, r.name, e_eager)
            # an untouched matrix stays bit for bit
            if g is None:
                assert np.array_equal(fast, st["before"][r.name]), (t, r.name)
    return worst


# ------------------------------------------------------------------ tests: routing
def test_routes_follow_the_specification():
    """The reference's routing on Zoo is what the specification's rules give, read off by hand."""
    routes = {r.name: (r.kind, r.reason, r.stack) for r in route_parameters(make_model())}
    assert routes == {
        "emb.weight": ("adam", "embedding", None),
        "q.weight": ("matrix", "matrix", (1, 16, 16)),
        "k.weight": ("matrix", "matrix", (1, 16, 16)),
        "fc1.weight": ("matrix", "matrix", (1, 48, 16)),
        "fc1.bias": ("adam", "scalar/vector", None),
        "fc2.weight": ("matrix", "matrix", (1, 16, 48)),
        "fc2.bias": ("adam", "scalar/vector", None),
        "ln.weight": ("adam", "scalar/vector", None),
        "ln.bias": ("adam", "scalar/vector", None),
        "gain": ("adam", "scalar/vector", None),
        "head.weight": ("adam", "output head", None),
    }
    plus = {r.name: (r.kind, r.reason, r.stack)
            for r in route_parameters(make_model(ZooPlus), split_rows={"qkv.weight": 3})}
    assert plus["conv.weight"] == ("matrix", "conv (flattened)", (1, 8, 12))
    assert plus["experts"] == ("matrix", "stack", (3, 16, 8))
    assert plus["qkv.weight"] == ("matrix", "matrix", (3, 16, 16))
    assert plus["conv.bias"] == ("adam", "scalar/vector", None)


def test_drop_in_routes_like_the_reference():
    """The drop-in's banks and Adam set against the reference's routes (bank = equal rows, cols, dtype)."""
    model = make_model()
    routes = route_parameters(model)
    opt = ANVIL(make_model(), **KW, compile=False)
    banked = {n for ns in opt.banks.values() for n in ns}
    assert banked == {r.name for r in routes if r.kind == "matrix"}
    assert set(opt.adam_names) == {r.name for r in routes if r.kind == "adam"}
    for names in opt.banks.values():
        assert len({next(r.stack[1:] for r in routes if r.name == n) for n in names}) == 1, names


def test_default_head_names_are_the_specifications():
    import inspect

    assert inspect.signature(DropInAnvil).parameters["head_names"].default == SPEC_HEAD_NAMES


# ------------------------------------------------------------------ tests: the step
def test_steps_match_the_reference_with_every_value_changed_mid_run():
    """Six steps with non-default values for every hyperparameter, all group values changed before
    step 3: every parameter within its bound after every step."""
    check_run()


def test_bf16_model_keeps_exact_fp32_masters():
    """A bf16 model: each matrix's master (bf16 parameter + mantissa) follows the float64 reference
    as an fp32 model's does; Adam's bf16 parameters are rounded to bf16 on both sides every step."""
    check_run(dtype=torch.bfloat16, steps=4)


def test_adam_through_the_triton_kernel(monkeypatch):
    """The same run with Adam in the Triton kernel (the interpreter on CPU; CUDA takes it always):
    the rows no token reached (zero gradient, zero moments, u = 0) must not decay."""
    import anvil_fast.kernels.adam as adam_mod

    monkeypatch.setattr(adam_mod, "use_triton", lambda t, backend: backend != "torch")
    check_run(steps=3, eager=False)


def test_members_without_gradient_are_untouched():
    """The specification: weights and state of a parameter without .grad stay bit for bit, also in a
    bank whose other members step; Adam's step count does not advance."""
    check_run(no_grad={1: {"q.weight", "gain"}, 4: {"q.weight", "ln.bias"}})


def test_step_returns_the_closures_loss():
    model = make_model()
    opt = ANVIL(model, **KW, compile=False)
    seq = gradient_sequence(route_parameters(model), 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def closure():
        for n, p in model.named_parameters():
            p.grad = seq[0][n].clone()
        return torch.tensor(2.75)

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() == 2.75
    assert not torch.equal(model.q.weight, before["q.weight"])  # the closure's gradients were used


# ------------------------------------------------------------------ tests: the specification's additions
def test_conv_stack_and_split_rows_match_the_reference():
    check_run(ZooPlus, kw=dict(KW, split_rows={"qkv.weight": 3}), eager=False)


def test_weights_stored_in_out_step_as_their_linear_layout():
    routes = {r.name: r for r in route_parameters(make_model(ZooT))}
    assert routes["c_fc.weight"].transposed and routes["c_fc.weight"].stack == (1, 16, 48)
    check_run(ZooT, eager=False)


def test_a_square_weight_stored_in_out_steps_as_its_linear_layout():
    check_run(ZooTSquare, eager=False)


def test_lr_scale_match_rms_adamw():
    check_run(kw=dict(KW, lr_scale="match_rms_adamw"), eager=False)


def test_record_rails_set_the_group_values():
    kw = {k: v for k, v in KW.items() if k not in ("momentum", "fast_beta", "fast_weight")}
    kw.update(rails="record", total_steps=6)
    model = make_model()
    ref = DropinReference(make_model(), **kw)
    opt = ANVIL(model, **kw, compile=False)
    seq = gradient_sequence(ref.routes, 6)
    for t in range(6):
        for n, p in model.named_parameters():
            p.grad = seq[t][n].clone()
        opt.step()
        ref.step(seq[t])
        group = next(g for g in opt.param_groups if g["kind"] == "anvil")
        for k in ("momentum", "fast_beta", "fast_weight"):
            assert group[k] == ref.groups["anvil"][k], (t, k)
    for n, p in model.named_parameters():
        assert np.allclose(p.detach().double().numpy(), ref.value(n), rtol=TOL.DROPIN_STEP_REL, atol=1e-3), n
    with pytest.raises(ValueError, match="total_steps"):
        opt.step()


def test_nonfinite_gradient_skips_the_whole_step():
    model = make_model()
    opt = ANVIL(model, **KW, compile=False)
    seq = gradient_sequence(route_parameters(model), 1)
    for n, p in model.named_parameters():
        p.grad = seq[0][n].clone()
    model.fc2.bias.grad[3] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match="fc2.bias"):
        opt.step()
    assert opt.skipped_steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


# ------------------------------------------------------------------ AnvilAndAdam: maps= and a replicated tied lm_head
#: The table a user of AnvilAndAdam writes (the reference gets the same literal, not the optimizer's).
TIED_TABLE = {
    "mat": {"optim": "anvil", "comms": "sharded"},
    "embed": {"optim": "adam", "comms": "replicated", "adam_betas": [0.8, 0.9]},
    "lm_head": {"optim": "adam", "comms": "replicated", "adam_betas": [0.8, 0.9]},
    "gain": {"optim": "adam", "comms": "replicated", "adam_betas": [0.7, 0.95]},
}
TIED_ADAM = dict(lr=0.02, eps=1e-8, weight_decay=0.3)
TIED_ANVIL = dict(lr=0.03, momentum=0.85, beta2=0.7, weight_decay=1.5)


def test_anvil_and_adam_with_maps_and_a_replicated_tied_lm_head():
    """AnvilAndAdam with a three-map cascade (maps=) and replicated tied embed/lm_head against
    ReferenceAnvilAndAdam built from the same user table: lm_head's step reads its gradient plus
    embed's transposed, and embed = lm_head^T afterwards."""
    from anvil_fast.optim.optimizer import AnvilAndAdam
    from anvil_ref import ANVIL_MAPS, ParamSpec, ReferenceAnvilAndAdam

    maps = ANVIL_MAPS[:3]
    g = torch.Generator().manual_seed(21)
    head = (torch.randn(8, 24, generator=g) * 0.2)
    values = {"mat": (torch.randn(4 * 16, 8, generator=g) * 0.2), "embed": head.T.contiguous(), "lm_head": head,
              "gain": torch.ones(3)}
    params = []
    for label, v in values.items():
        p = nn.Parameter(v.clone())
        p.label = label
        if label == "mat":
            p.reshape = (4, 16, 8)
        params.append((label, p))
    opt = AnvilAndAdam(params, TIED_TABLE, list(TIED_TABLE), list(TIED_TABLE), TIED_ADAM, TIED_ANVIL,
                       allow_fp32_banks=True, bank_config="faithful", maps=maps)
    ref = ReferenceAnvilAndAdam({"mat": ParamSpec(values["mat"].numpy(), (4, 16, 8)),
                                 **{k: values[k].numpy() for k in ("embed", "lm_head", "gain")}},
                                TIED_TABLE, adam_defaults=TIED_ADAM, anvil_defaults=TIED_ANVIL, maps=maps)
    assert opt.param_cfgs["lm_head"].comms == "replicated" and opt.tied
    bounds = {l: AdamBound(values[l].shape) for l in ("lm_head", "gain")}
    p = dict(params)
    for t in range(3):
        grads = {"mat": _bf16_exact(torch.stack([well_conditioned(16, 8, g) for _ in range(4)]).float()
                                    .reshape(64, 8) * 0.05),
                 "embed": _bf16_exact(torch.randn(24, 8, generator=g) * 0.1),
                 "lm_head": _bf16_exact(torch.randn(8, 24, generator=g) * 0.1),
                 "gain": _bf16_exact(torch.randn(3, generator=g) * 0.1)}
        before = {l: v.copy() for l, v in ref.params.items()}
        st0 = copy.deepcopy(ref.state)
        mat_before = p["mat"].detach().double().numpy().copy()
        for l, gr in grads.items():
            p[l].grad = gr.clone()
        opt.step(do_adam=True)
        ref.step({l: gr.double().numpy() for l, gr in grads.items()}, do_adam=True)
        for l in ("lm_head", "gain"):
            gl = grads[l].double().numpy() + (grads["embed"].double().numpy().T if l == "lm_head" else 0)
            b1b2 = tuple(TIED_TABLE[l]["adam_betas"])
            bounds[l].step(before[l], gl, st0[l]["exp_avg"], st0[l]["exp_avg_sq"], step=t + 1, lr=TIED_ADAM["lr"],
                           betas=b1b2, eps=TIED_ADAM["eps"], weight_decay=TIED_ADAM["weight_decay"])
            err = np.abs(p[l].detach().double().numpy() - ref.params[l])
            assert (err <= bounds[l].e_p).all(), (t, l, float(err.max()), float(bounds[l].e_p.max()))
        assert torch.equal(p["embed"].detach(), p["lm_head"].detach().T)
        d_fast = torch.from_numpy(p["mat"].detach().double().numpy() - mat_before).reshape(4, 16, 8)
        d_ref = torch.from_numpy(ref.params["mat"] - before["mat"]).reshape(4, 16, 8)
        assert rel_err(d_fast, d_ref) <= TOL.DROPIN_STEP_REL, (t, rel_err(d_fast, d_ref))


# ------------------------------------------------------------------ two ranks against one process
WORLD = 2
SPAWN_TIMEOUT_S = 240  # the whole session; a collective waits at most COLLECTIVE_TIMEOUT_S
COLLECTIVE_TIMEOUT_S = 30  # every collective here takes milliseconds; waiting longer is a hang


def _finite_check_kw(mode: str) -> dict:
    """``mode`` "raise": refuse a non-finite step by raising (the specification's nonfinite="raise",
    check_finite=True where the drop-in has no nonfinite=); "skip": the specification's default."""
    import inspect

    if mode == "skip":
        return dict(nonfinite="skip")
    params = inspect.signature(DropInAnvil).parameters
    return dict(nonfinite="raise") if "nonfinite" in params else dict(check_finite=True)


def _run_dropin(model, opt, steps: int, rank: int | None, world: int = WORLD) -> None:
    """Each rank's own gradient sequence (check_run's kind, seeded by rank), or with ``rank`` None
    their mean, ``(g_0 + g_1) / 2`` in float32: the bf16-exact gradients of two ranks add exactly in
    float32, and a sum of two rounded once (gloo, in the bucket's dtype) then halved is that mean
    rounded once. Every group value changes before CHANGE_AT."""
    routes = route_parameters(model)
    per_rank = [gradient_sequence(routes, steps, seed=11 + 1000 * r) for r in range(world)]
    if rank is None:
        seq = [{n: sum(s[t][n] for s in per_rank) / world for n in per_rank[0][t]} for t in range(steps)]
    else:
        seq = per_rank[rank]
    for t in range(steps):
        if t == CHANGE_AT:
            for kind, vals in CHANGED.items():
                next(g for g in opt.param_groups if g["kind"] == kind).update(vals)
        for n, p in model.named_parameters():
            p.grad = seq[t][n].clone()
        opt.step()


def _rank_main(rank: int, world: int, folder: str, mode: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    model = make_model()
    opt = ANVIL(model, **KW, shard_min_numel=64, bank_config="faithful", compile=False, **_finite_check_kw(mode))
    _run_dropin(model, opt, STEPS, rank, world)
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "sharded": {n: c for n, c in opt.adam_names.items()} if hasattr(opt, "adam_names") else {}}
    # a NaN on rank 1 only: every rank must refuse the step, nothing written, no hang
    seq = gradient_sequence(route_parameters(model), 1, seed=99)
    for n, p in model.named_parameters():
        p.grad = seq[0][n].clone()
    if rank == 1:
        model.fc1.bias.grad[0] = float("nan")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        out["nonfinite"] = "stepped; warned: " + "; ".join(f"{w.category.__name__}: {w.message}" for w in caught)
    except Exception as e:  # noqa: BLE001  (the message is the result)
        out["nonfinite"] = f"{type(e).__name__}: {e}"
    out["skipped_steps"] = getattr(opt, "skipped_steps", None)
    out["unchanged"] = all(torch.equal(p.detach(), out["params"][n]) for n, p in model.named_parameters())
    torch.save(out, os.path.join(folder, f"result{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def spawn_with_timeout(fn, world: int, timeout_s: float, *args) -> list[dict]:
    """Run ``fn(rank, world, folder, *args)`` on ``world`` spawned processes; fail (after stopping them) if
    they have not all finished within ``timeout_s`` or a rank died (a collective that timed out: ranks
    that disagree on whether to step wait for each other)."""
    import os
    import tempfile
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="anvil_dropin_") as folder:
        ctx = mp.start_processes(fn, args=(world, folder, *args), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            try:
                while not ctx.join(timeout=1.0):
                    if time.monotonic() > deadline:
                        raise AssertionError(f"the {world} ranks did not finish within {timeout_s} s (a hang)")
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                raise AssertionError(f"a rank failed (a collective waited in vain, or an error): {e}") from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [torch.load(os.path.join(folder, f"result{r}.pt"), weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.distributed
def test_dropin_two_ranks_against_one_process():
    """Two gloo ranks (padded, sharded banks; sharded and replicated Adam), each with its own
    gradients, against the single-process run on their mean: equal bit for bit, since the mean is
    rounded once on both sides (_run_dropin) and every update is elementwise or per matrix (no
    reduction spans ranks). With more ranks, or gradients whose sums round more than once, the
    summation order would differ and only the reference's tolerances would hold. Then a NaN on rank
    1 alone: both ranks refuse the step, nothing written, no hang."""
    res = spawn_with_timeout(_rank_main, WORLD, SPAWN_TIMEOUT_S, "raise")
    model = make_model()
    opt = ANVIL(model, **KW, bank_config="faithful", compile=False)
    _run_dropin(model, opt, STEPS, None)
    assert "sharded" in res[0]["sharded"].values() and "replicated" in res[0]["sharded"].values()
    for r, out in enumerate(res):
        for n, p in model.named_parameters():
            assert torch.equal(out["params"][n], p.detach()), (r, n)
        assert "non-finite" in out["nonfinite"] and "fc1.bias" in out["nonfinite"], (r, out["nonfinite"])
        assert out["unchanged"], r


@pytest.mark.slow
@pytest.mark.distributed
def test_dropin_two_ranks_skip_a_step_nan_on_one_rank():
    """nonfinite="skip" (the default): a NaN on rank 1 alone makes both ranks skip the step, warn
    naming the parameter and count it; nothing written, no hang."""
    res = spawn_with_timeout(_rank_main, WORLD, SPAWN_TIMEOUT_S, "skip")
    for r, out in enumerate(res):
        assert out["nonfinite"].startswith("stepped; warned: NonFiniteGradientWarning"), (r, out["nonfinite"])
        assert "fc1.bias" in out["nonfinite"], (r, out["nonfinite"])
        assert out["unchanged"] and out["skipped_steps"] == 1, (r, out["skipped_steps"])


def test_describe_and_plan_follow_the_reference_routes():
    model = make_model(ZooPlus)
    routes = route_parameters(model, split_rows={"qkv.weight": 3})
    opt = ANVIL(make_model(ZooPlus), **KW, split_rows={"qkv.weight": 3}, compile=False)
    text = opt.describe()
    for r in routes:
        assert r.name in text and r.reason in text, r
    assert len(opt.plan) == len(routes)


def test_group_values_are_validated_and_adam_momentum_is_beta1():
    model = make_model()
    opt = ANVIL(model, **KW, compile=False)
    seq = gradient_sequence(route_parameters(model), 2)
    anvil_group, adam_group = opt.param_groups
    for n, p in model.named_parameters():
        p.grad = seq[0][n].clone()
    anvil_group["beta2"] = 1.5
    with pytest.raises(ValueError, match="beta2"):
        opt.step()
    anvil_group["beta2"] = KW["beta2"]
    adam_group["momentum"] = 0.55  # a momentum-cycling scheduler's write: Adam's beta1
    opt.step()
    assert tuple(adam_group["betas"]) == (0.55, KW["adam_betas"][1])
    with pytest.raises(ValueError, match="add_param_group: lr=0.5 differs"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.5})
