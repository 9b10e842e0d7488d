"""The training harness (papers.train): corpus split, batch order, seeding, statistics, and a tiny
model that really learns with AdamW and with ANVIL on the CPU."""

from __future__ import annotations

import inspect
import json
import math
import zlib

import pytest
import torch

from anvil_fast import gpt
from papers import contenders as K
from papers import corpus as C
from papers import stats as S
from papers import train as T
from papers import training as TR


@pytest.fixture(scope="module")
def stdlib() -> C.Corpus:
    return C.load()


# ----------------------------------------------------------------------------------- corpus
def _tree(tmp_path):
    files = {"a.py": b"print(1)\n", "pkg/b.py": b"x = 2\n", "pkg/sub/c.py": b"def f():\n    pass\n",
             "d.py": b"import os\n", "v8.py": b"y=3\n", "notes.txt": b"not python",
             "site-packages/third/x.py": b"third party", "pkg/dist-packages/y.py": b"third party"}
    for rel, data in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def test_file_list_excludes_site_packages_and_non_python(tmp_path):
    _tree(tmp_path)
    assert C.list_files(tmp_path) == ["a.py", "d.py", "pkg/b.py", "pkg/sub/c.py", "v8.py"]


def test_split_is_by_file_by_the_crc_rule_disjoint_and_complete(tmp_path):
    files = _tree(tmp_path)
    paths = C.list_files(tmp_path)
    tr, va = C.split(paths)
    assert sorted(tr + va) == paths and not set(tr) & set(va)
    assert va == [p for p in paths if zlib.crc32(p.encode()) % 10 == 0] == ["v8.py"]
    # the rule depends on the path alone: a file's side does not change when others are removed
    assert C.split(paths[1:]) == ([p for p in tr if p != paths[0]], [p for p in va if p != paths[0]])
    # the bytes of a split are its files concatenated in sorted order
    c = C.load(tmp_path)
    assert bytes(c.train.numpy()) == b"".join(files[p] for p in tr)
    assert bytes(c.val.numpy()) == b"".join(files[p] for p in va)
    (tmp_path / "v8.py").unlink()
    with pytest.raises(ValueError, match="both must be non-empty"):
        C.load(tmp_path)


def test_stdlib_split_covers_every_byte_and_is_deterministic(stdlib):
    root = C.stdlib_root()
    paths = C.list_files(root)
    sizes = [(root / p).stat().st_size for p in paths]
    assert stdlib.n_train_files + stdlib.n_val_files == stdlib.n_files == len(paths)
    assert stdlib.train.numel() + stdlib.val.numel() == sum(sizes)
    assert stdlib.sha256 == C.file_list_sha256(paths, sizes) == C.load().sha256
    assert 0.05 < stdlib.n_val_files / stdlib.n_files < 0.2  # about 1 in VAL_MODULUS files


def test_file_list_hash_sees_paths_and_sizes():
    h = C.file_list_sha256(["a.py", "b.py"], [1, 2])
    assert h != C.file_list_sha256(["a.py", "c.py"], [1, 2])
    assert h != C.file_list_sha256(["a.py", "b.py"], [1, 3])


def test_unigram_entropy_hand_cases():
    assert C.unigram_entropy(torch.tensor([7, 7, 7], dtype=torch.uint8)) == 0.0
    assert C.unigram_entropy(torch.tensor([0, 1, 2, 3], dtype=torch.uint8)) == pytest.approx(math.log(4), rel=1e-12)
    assert C.unigram_entropy(torch.tensor([0, 0, 0, 1], dtype=torch.uint8)) == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), rel=1e-12)


# ------------------------------------------------------------------------------ batch order
def test_batches_same_seed_same_batches_other_seed_other_batches():
    data = torch.arange(1000, dtype=torch.int64).remainder(251).to(torch.uint8)
    a = C.train_batches(data, steps=5, batch=4, ctx=16, data_seed=3)
    b = C.train_batches(data, steps=5, batch=4, ctx=16, data_seed=3)
    c = C.train_batches(data, steps=5, batch=4, ctx=16, data_seed=4)
    assert a.shape == (5, 4, 17) and a.dtype == torch.uint8
    assert torch.equal(a, b) and C.batches_sha256(a) == C.batches_sha256(b)
    assert not torch.equal(a, c) and C.batches_sha256(a) != C.batches_sha256(c)
    # step s's batch depends on (data_seed, s) only: a shorter run sees a prefix of a longer one
    assert torch.equal(C.train_batches(data, steps=3, batch=4, ctx=16, data_seed=3), a[:3])
    # distinct (data_seed, step) pairs give distinct generator seeds (torch keeps 32 bits of a seed)
    seeds = {C.step_seed(d, s) for d in (0, 1, C.MAX_DATA_SEED - 1) for s in (0, 1, C.STEP_SEED_STRIDE - 1)}
    assert len(seeds) == 9 and max(seeds) < 1 << 32
    with pytest.raises(ValueError, match="data seed"):
        C.step_seed(C.MAX_DATA_SEED, 0)
    # every window is ctx + 1 consecutive bytes of the data
    starts = a[..., 0].long()
    expected = (starts[..., None] + torch.arange(17)).remainder(251)
    assert torch.equal(a.long(), expected)


def test_validation_windows_are_fixed_and_too_short_data_is_refused():
    data = torch.arange(500, dtype=torch.int64).remainder(256).to(torch.uint8)
    assert torch.equal(C.val_windows(data, n=8, ctx=10), C.val_windows(data, n=8, ctx=10))
    with pytest.raises(ValueError, match="fewer than one window"):
        C.windows(data[:5], 1, 11, seed=0)


# --------------------------------------------------------------------------------- seeding
def test_model_init_follows_the_seed_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = (gpt.build("tiny", seed=s).state_dict() for s in (5, 5, 6))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].ndim >= 2)


def test_lr_shape_warmup_then_linear_decay():
    assert [T.lr_shape(s, steps=6, warmup=2) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


# ------------------------------------------------------------------------------ statistics
def test_loss_at_and_steps_to_target_hand_cases():
    st, ls = [0, 10, 20], [5.0, 3.0, 1.0]
    assert S.loss_at(st, ls, 15) == 2.0 and S.loss_at(st, ls, 0) == 5.0 and S.loss_at(st, ls, 20) == 1.0
    assert S.steps_to_target(st, ls, 2.0) == 15.0
    assert S.steps_to_target(st, ls, 3.0) == 10.0     # reached exactly at an evaluation
    assert S.steps_to_target(st, ls, 6.0) == 0.0      # already at the start
    assert S.steps_to_target(st, ls, 0.5) == math.inf
    assert S.steps_to_target([0, 10, 20], [5.0, 1.0, 4.0], 2.0) == 7.5   # the first crossing counts
    with pytest.raises(ValueError, match="outside"):
        S.loss_at(st, ls, 21)
    with pytest.raises(ValueError, match="increase"):
        S.steps_to_target([0, 0], [1.0, 2.0], 1.0)


def test_summary_and_mean_curve_hand_cases():
    s = S.summary([1.0, 2.0, 3.0])
    assert (s["n"], s["mean"], s["std"], s["min"], s["max"]) == (3, 2.0, 1.0, 1.0, 3.0)
    assert math.isnan(S.summary([4.0])["std"])
    assert S.summary([1.0, math.inf])["mean"] == math.inf
    assert S.mean_curve([([0, 1], [4.0, 2.0]), ([0, 1], [2.0, 1.0])]) == ([0, 1], [3.0, 1.5])
    with pytest.raises(ValueError, match="different steps"):
        S.mean_curve([([0, 1], [4.0, 2.0]), ([0, 2], [2.0, 1.0])])
    assert S.fmt_spread([1.0, 2.0, 3.0], 1) == "2.0 ± 1.0 [1.0, 3.0]"
    assert S.fmt_spread([1.0, math.inf, math.inf]) == "not reached (1/3 seeds)"


def test_verdict_rule():
    # means 1.0 and 2.0, spreads 0.1: measurable
    assert S.verdict([0.9, 1.0, 1.1], [1.9, 2.0, 2.1], ("x", "y")) == "x lower"
    assert S.verdict([1.9, 2.0, 2.1], [0.9, 1.0, 1.1], ("x", "y")) == "y lower"
    # difference 0.1, larger std 0.2: within the spread
    assert S.verdict([0.8, 1.0, 1.2], [1.05, 1.1, 1.15]) == S.NO_DIFFERENCE
    # exactly at the spread is not measurable (|d| <= spread); just above it is
    assert S.verdict([0.0, 1.0, 2.0], [2.0, 2.0, 2.0]) == S.NO_DIFFERENCE
    assert S.verdict([0.0, 1.0, 2.0], [2.5, 2.5, 2.5], ("x", "y")) == "x lower"
    assert S.verdict([1.0], [2.0, 2.1]) == S.NOT_ENOUGH
    assert S.verdict([5.0, 6.0], [math.inf, math.inf], ("x", "y")) == "x lower"
    assert S.verdict([5.0, math.inf], [math.inf, math.inf]) == S.NO_DIFFERENCE


def test_sweep_best_picks_lowest_mean_final_loss():
    recs = [{"contender": "adamw", "hparams": {"lr": lr}, "final_val_loss": v}
            for lr, v in ((1e-3, 3.0), (2e-3, 2.5), (2e-3, 2.9), (4e-3, 2.6), (8e-3, math.nan))]
    assert T.sweep_best(recs) == {"adamw": 4e-3}   # 2e-3's mean is 2.7


def _record(name, seed, losses, step_s=0.01):
    steps = [0, 10, 20]
    return {"format": TR.FORMAT, "contender": name, "seed": seed, "size": "tiny", "sweep": False,
            "hparams_text": "x", "steps": 20, "batch": 2, "ctx": 4, "model": {"n_params": 1000},
            "environment": {"device": "cpu", "torch": "t"}, "corpus": {"sha256": "0" * 64, "train_bytes": 9},
            "curve": [{"step": s, "val_loss": v} for s, v in zip(steps, losses)], "final_val_loss": losses[-1],
            "diverged": False, "timing": {"step_s": step_s, "opt_share": 0.5}}


def test_training_tables_from_hand_made_runs(tmp_path):
    runs = [_record("adamw", 0, [5.0, 3.0, 2.0]), _record("adamw", 1, [5.0, 3.0, 2.2]),
            _record("muon", 0, [5.0, 2.5, 1.5]), _record("muon", 1, [5.0, 2.5, 1.5])]
    for i, r in enumerate(runs):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    runs = TR.load(tmp_path)
    assert len(runs) == 4
    g = TR.groups(runs, "tiny")
    assert TR.target(g) == pytest.approx(2.1)
    m = TR.metrics(g)
    # adamw's mean curve ends exactly at the target; muon's mean curve crosses 2.1 between
    # (10, 2.5) and (20, 1.5): 10 + 0.4 / 1.0 * 10 = 14
    assert m["adamw"]["to_target_mean_curve"] == pytest.approx(20.0)
    assert m["muon"]["to_target_mean_curve"] == pytest.approx(14.0)
    anchor = TR.table_anchor(runs)
    assert "14 / 20" in anchor and "| 0.70 |" in anchor and "| 0.58 |" in anchor
    assert "muon lower" in TR.table_verdicts(runs)
    assert TR.figure_loss(runs, "tiny").startswith("<svg")
    assert "no training run yet" in TR.table_results(runs, "medium")


def test_equal_time_ranks_only_measurably_different_speeds():
    adamw = [_record("adamw", 0, [5.0, 3.0, 2.0], step_s=0.010), _record("adamw", 1, [5.0, 3.0, 2.2], step_s=0.012)]
    # times per step within each other's spread: equal time is equal steps, so no time-based ranking
    close = [_record("muon", s, [5.0, 2.5, 1.5], step_s=0.011) for s in (0, 1)]
    assert TR._equal_time(adamw, close) == TR.SAME_SPEED
    # muon 4x slower per step: at adamw's whole-run time (20 steps x 0.011 s = 0.22 s) muon has made
    # 0.22 / 0.04 = 5.5 steps, where its curve is at 5.0 - 2.5 * 5.5 / 10 = 3.625
    slow = [_record("muon", s, [5.0, 2.5, 1.5], step_s=0.04) for s in (0, 1)]
    la, lb, t = TR._equal_time(adamw, slow)
    assert t == pytest.approx(0.22) and lb == pytest.approx([3.625, 3.625]) and la == pytest.approx([2.0, 2.2])
    rows = TR.table_verdicts(adamw + slow)
    assert "| muon lower | adamw lower (at 0.2 s) |" in rows.replace("Muon vs AdamW", "")
    assert TR.SAME_SPEED in TR.table_verdicts(adamw + close)


# ------------------------------------------------------------------------------ contenders
def test_muon_takes_the_blocks_matrices_only():
    names = K.muon_params(gpt.build("tiny"))
    assert names and all(n.startswith("blocks.") for n in names)
    assert not {"wte.weight", "wpe.weight", "lm_head.weight"} & set(names)


@pytest.mark.parametrize("name", list(K.REGISTRY))
def test_every_contender_builds_on_the_tiny_model(name):
    import anvil_fast

    c = K.get(name)
    accepted = inspect.signature(anvil_fast.ANVIL.__init__).parameters
    missing = [k for k in c.hparams if c.build is K.build_anvil and k not in accepted]
    if missing:
        pytest.skip(f"anvil_fast.ANVIL does not accept {missing} in this checkout yet")
    opts = c.make(gpt.build("tiny"), total_steps=4, device=torch.device("cpu"))
    assert opts and all(isinstance(o, torch.optim.Optimizer) for o in opts)
    assert "lr=" in K.hparams_text(c) or c.build is K.build_anvil


def test_gram_side_contender_trains_the_tiny_model(stdlib):
    """anvil_gram_side runs the Gram side on the tiny model's tall and wide banks (its MLP matrices,
    256 x 64 and 64 x 256) and learns: 30 steps on the same batches as anvil end finite and below the
    initial validation loss (measured 5.59 -> 2.92), within 0.1 of anvil's (measured: 2.4e-4 apart; the
    path's accuracy is judged in tests/test_gram_side.py, this checks that the contender wires it in)."""
    from anvil_fast.gram_side import uses_gram_side

    opt = K.get("anvil_gram_side").make(gpt.build("tiny"), total_steps=30, device=torch.device("cpu"))[0]
    banks = list(opt.inner.banks.values())
    assert any(b.config.name == "gram_side" and uses_gram_side(b.p_slice.shape) for b in banks)
    val = C.val_windows(stdlib.val, n=16, ctx=gpt.SIZES["tiny"].ctx)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recs = {n: T.train_run(K.get(n), size="tiny", seed=0, data_seed=0, steps=30, batch=8, warmup=3,
                               eval_every=30, corpus=stdlib, val=val, device=torch.device("cpu"), timing_steps=0)
                for n in ("anvil", "anvil_gram_side")}
    finally:
        torch.set_num_threads(threads)
    g, a = recs["anvil_gram_side"], recs["anvil"]
    assert g["batches_sha256"] == a["batches_sha256"]
    assert math.isfinite(g["final_val_loss"]) and g["final_val_loss"] < g["curve"][0]["val_loss"] - 0.5
    assert abs(g["final_val_loss"] - a["final_val_loss"]) < 0.1, (g["final_val_loss"], a["final_val_loss"])


# ------------------------------------------------------------------------ the tiny training
def test_tiny_model_learns_with_adamw_and_anvil_on_identical_batches(stdlib):
    """200 steps of 16 x 64 bytes: both optimizers end below the unigram entropy of the train split,
    which the untrained model (about ln 256) is far above, having trained on the same batches.
    Fewer steps leave this model near the unigram plateau on some seeds (measured: at 80 steps one
    of seeds 0-2 ended above it with each optimizer); at 200 steps seeds 0-2 end >= 0.26 below."""
    h = C.unigram_entropy(stdlib.train)
    val = C.val_windows(stdlib.val, n=32, ctx=gpt.SIZES["tiny"].ctx)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same reduction order on every machine, and no spinning on a busy host
    try:
        recs = {n: T.train_run(K.get(n), size="tiny", seed=0, data_seed=0, steps=200, batch=16, warmup=10,
                               eval_every=200, corpus=stdlib, val=val, device=torch.device("cpu"), timing_steps=0)
                for n in ("adamw", "anvil_defaults")}
    finally:
        torch.set_num_threads(threads)
    assert recs["adamw"]["batches_sha256"] == recs["anvil_defaults"]["batches_sha256"]
    for n, r in recs.items():
        assert [c["step"] for c in r["curve"]] == [0, 200], n
        assert r["curve"][0]["val_loss"] > h + 1.0, n           # the bound is not met by chance at init
        assert r["final_val_loss"] < h, (n, r["final_val_loss"], h)
    assert recs["adamw"]["curve"][0] == recs["anvil_defaults"]["curve"][0]  # same initial weights


def test_cli_writes_a_run_json_and_respects_the_time_budget(tmp_path):
    args = ["--size", "tiny", "--steps", "4", "--batch", "2", "--eval-every", "2", "--val-windows", "4",
            "--contenders", "adamw", "--seeds", "0", "--timing-warmup", "1", "--timing-steps", "2"]
    assert T.main(args + ["--out", str(tmp_path / "a")]) == 0
    (path,) = (tmp_path / "a").glob("*.json")
    r = json.loads(path.read_text())
    assert path.name == "tiny-adamw-seed0.json"
    assert [c["step"] for c in r["curve"]] == [0, 2, 4]
    assert r["hparams"]["lr"] == K.ADAMW_HP["lr"] and r["corpus"]["sha256"] == C.load().sha256
    assert r["timing"]["timed_steps"] == 2 and 0 < r["timing"]["opt_share"] < 1
    assert T.main(args + ["--out", str(tmp_path / "b"), "--time-budget-s", "0"]) == 0
    assert not list((tmp_path / "b").glob("*.json"))


def test_cli_takes_the_tuned_lr_from_sweep_jsons(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for lr, loss in ((1e-3, 3.0), (2e-3, 2.5), (4e-3, 2.8)):
        (sweep / f"{lr}.json").write_text(json.dumps({"format": T.FORMAT, "contender": "adamw", "size": "small",
                                                      "sweep": True, "hparams": {"lr": lr}, "final_val_loss": loss}))
    args = ["--size", "tiny", "--steps", "2", "--batch", "2", "--eval-every", "2", "--val-windows", "2",
            "--contenders", "adamw", "--seeds", "0", "--timing-steps", "0", "--tuned-from", str(sweep)]
    with pytest.raises(SystemExit) as exc:
        T.main(args + ["--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "no sweep JSON of size tiny" in capsys.readouterr().err
    assert T.main(args + ["--tuned-size", "small", "--out", str(tmp_path / "a")]) == 0
    r = json.loads((tmp_path / "a" / "tiny-adamw-seed0.json").read_text())
    assert r["hparams"]["lr"] == 2e-3 and r["optimizer_groups"][0]["initial_lr"] == 2e-3


@pytest.mark.gpu
def test_cuda_every_default_contender_trains_the_small_model(stdlib):
    """The CUDA path (bf16 autocast, fused AdamW, ANVIL's GPU update): 30 steps of the small model,
    every contender of the comparison ends with a finite validation loss below its initial one."""
    import anvil_fast

    accepted = inspect.signature(anvil_fast.ANVIL.__init__).parameters
    val = C.val_windows(stdlib.val, n=16, ctx=gpt.SIZES["small"].ctx)
    for n in K.DEFAULT_CONTENDERS:
        c = K.get(n)
        if c.build is K.build_anvil and any(k not in accepted for k in c.hparams):
            continue  # test_every_contender_builds_on_the_tiny_model reports these as skipped
        r = T.train_run(c, size="small", seed=0, data_seed=0, steps=30, batch=8, warmup=3, eval_every=30,
                        corpus=stdlib, val=val, device=torch.device("cuda"), timing_warmup=2, timing_steps=3)
        first, last = r["curve"][0]["val_loss"], r["final_val_loss"]
        assert math.isfinite(last) and last < first - 1.0, (n, first, last)
        assert r["timing"]["step_s"] > 0 and 0 < r["timing"]["opt_share"] < 1, n
