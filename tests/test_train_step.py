"""anvil_fast.studies.train_step (with anvil_fast.optim.overlap and anvil_fast.models.banked_gpt): the overlapped training step (reduce-scatters launched from the backward
pass) against the non-overlapped one, on 2 gloo processes (CPU) and 2 GPUs (gpu marker)."""

from __future__ import annotations

import pytest
import torch

from anvil_fast.models import banked_gpt as BG
from anvil_fast.optim import overlap as OV
from anvil_fast.studies import train_step as TS
from anvil_fast.parallel.distributed import all_digests, replica_digest, spawn
from anvil_fast.models.gpt import SIZES, GPTConfig

WORLD = 2
STEPS = 3
KW = dict(global_batch=4, seq=32)


def _session(rank: int, world: int, device: str) -> dict:
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    compile_banks = None if device == "cuda" else False
    cfg = SIZES["tiny"]
    init = replica_digest([p.data for _, p in BG.BankedGPT(cfg, group_layers=1, seed=0).labelled()])
    out = {"init": init}
    for variant in (*OV.WAIT_MODES, "prehook_forward", "prehook_mixed"):
        mode, _, order = variant.partition("_")

        def fresh():
            model = BG.BankedGPT(cfg, group_layers=1, seed=0).to(dev)
            return model, OV.make_optimizer(model, compile_banks=compile_banks, work_order=order or "backward")

        launched = []

        def count(model, driver):
            # how many reduces are in flight when the backward pass reaches the first group
            model.groups[0].register_full_backward_pre_hook(lambda m, g: launched.append(len(driver._launched)))

        out[variant] = TS.paired_check(fresh, mode=mode, steps=STEPS, world=world, rank=rank, on_start=count, **KW)
        out[f"{variant}_launched"] = launched
    return out


def _check(res: list[dict]) -> None:
    d = res[0]
    for v in (*OV.WAIT_MODES, "prehook_forward", "prehook_mixed"):
        overlapped, sequential = d[v]
        assert len(set(overlapped)) == 1, f"{v}: the ranks' replicas differ"
        assert overlapped[0] != d["init"], f"{v}: the parameters did not move"
        assert overlapped == sequential, f"{v}: the overlapped schedule differs from the non-overlapped one"
    for r in res:
        for v in (*OV.WAIT_MODES, "prehook_forward", "prehook_mixed"):
            # before the backward pass reaches group 0: lm_head (on Adam steps: 1), mlp_bank1 and
            # attn_bank1 are complete and launched; step 0 and 2 read no Adam gradient
            assert r[f"{v}_launched"] == [2, 3, 2], r[f"{v}_launched"]


@pytest.mark.distributed
def test_overlapped_equals_sequential_on_two_gloo_ranks():
    _check(spawn(_session, WORLD, "cpu", backend="gloo"))


@pytest.mark.gpu
@pytest.mark.distributed
def test_overlapped_equals_sequential_on_two_gpus():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    _check(spawn(_session, WORLD, "cuda", backend="nccl", threads=0, timeout=TS.GPU_TIMEOUT_S))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_process_overlapped_equals_sequential(device):
    cfg = SIZES["tiny"]

    def fresh():
        model = BG.BankedGPT(cfg, group_layers=2, seed=0).to(device)
        return model, OV.make_optimizer(model, compile_banks=None if device == "cuda" else False)

    init = replica_digest([p.data for _, p in fresh()[0].labelled()])
    for mode in OV.WAIT_MODES:
        (a,), (b,) = TS.paired_check(fresh, mode=mode, steps=2, world=1, rank=0, **KW)
        assert a == b and a != init, mode


def test_separate_runs_on_cpu_agree_too():
    # the CPU backward is deterministic, so whole separate runs (own backward passes) agree as well
    cfg = SIZES["tiny"]
    digests = {}
    for mode in ("sequential", *OV.WAIT_MODES):
        model = BG.BankedGPT(cfg, group_layers=2, seed=0)
        opt = OV.make_optimizer(model, compile_banks=False)
        TS.train(model, opt, mode=mode, steps=2, world=1, rank=0, adam_every=2, **KW)
        digests[mode] = replica_digest([p.data for _, p in model.labelled()])
    assert digests["prehook"] == digests["sequential"] == digests["end"]


@pytest.mark.parametrize("order", BG.WORK_ORDERS)
def test_work_orders_list_every_label_once(order):
    model = BG.BankedGPT(SIZES["tiny"], group_layers=1)
    w = model.work_order(order)
    assert sorted(w) == sorted(l for l, _ in model.labelled()) and w[-1] == BG.NORMS_LABEL
    if order == "mixed":  # 2 groups: group 1 as it lands, the embeddings, then group 0
        assert w == ["lm_head", "mlp_bank1", "attn_bank1", "embed", "pos", "attn_bank0", "mlp_bank0", "norms"]
        # 3 groups (GPT-2 small in banks of 4 layers): the last gather is group 1's, read after group 0's forward
        three = BG.BankedGPT(GPTConfig(n_layer=3, n_embd=8, n_head=2, ctx=8, vocab=16), group_layers=1)
        assert three.work_order(order) == ["lm_head", "mlp_bank2", "attn_bank2", "embed", "pos", "attn_bank0",
                                           "mlp_bank0", "attn_bank1", "mlp_bank1", "norms"]


def test_global_batch_not_divisible_is_refused():
    with pytest.raises(ValueError, match="not divisible by the world size 2"):
        BG.check_batch(5, 2)
    rc = TS.main(["--device", "cpu", "--worlds", "1,2", "--global-batch", "3"])
    assert rc == 2


@pytest.mark.parametrize("args, match", [
    (["--group-layers", "3"], "must divide n_layer=2"),
    (["--worlds", "1,3", "--global-batch", "6"], "3 ranks cannot shard the attention bank"),
    (["--worlds", "1,x"], "comma-separated ints"),
    (["--seq", "65"], r"must lie in \[1, 64\]"),
])
def test_bad_settings_are_refused(args, match, capsys):
    assert TS.main(["--device", "cpu", *args]) == 2
    assert __import__("re").search(match, capsys.readouterr().err)


def test_refuses_finite_check_and_unknown_wait():
    from anvil_ref.config import ConfigError
    from anvil_fast.optim.optimizer import AnvilAndAdam

    model = BG.BankedGPT(SIZES["tiny"], group_layers=1)
    opt = AnvilAndAdam(model.labelled(), model.param_table(), model.scatter_order(), model.work_order(),
                       check_finite=True, tie_embeddings=False)
    with pytest.raises(ConfigError, match="check_finite"):
        OV.OverlappedStep(opt, model)
    with pytest.raises(ValueError, match="wait must be one of"):
        OV.OverlappedStep(OV.make_optimizer(model, compile_banks=False), model, wait="never")


def test_hidden_share_arithmetic():
    # 10 ms of compute, 4 ms of collectives: a 11 ms step hides 3 of the 4 ms
    assert TS.hidden_share(11.0, 10.0, 4.0) == pytest.approx(0.75)
    assert TS.hidden_share(14.0, 10.0, 4.0) == pytest.approx(0.0)


def test_cpu_smoke_table(tmp_path):
    out = tmp_path / "t.md"
    rc = TS.main(["--device", "cpu", "--worlds", "1,2", "--n-time", "1", "--warmup", "0", "--check-steps", "2",
                  "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert text.startswith("<!-- generated by `python -m anvil_fast.studies.train_step --device cpu")
    rows = [l for l in text.splitlines() if l.startswith("| 1 |") or l.startswith("| 2 |")]
    assert len(rows) == 2 and all(r.endswith("| yes |") for r in rows), rows
    # the record beside the table holds the rows' numbers, which the cost model reads
    from anvil_fast.studies.cost_model import read_train_step_run

    run = read_train_step_run(tmp_path / "t.json")
    assert sorted(run["rows"]) == [1, 2] and run["rows"][2]["batch"] == 2
    for w, row in zip((1, 2), rows):
        cells = [c.strip() for c in row.split("|")[1:-1]]
        r = run["rows"][w]
        assert cells[2:7] == [f"{r[k]:.2f}" for k in ("prehook_ms", "end_ms", "sequential_ms", "nocomm_ms", "comm_ms")]


def test_each_reduce_is_launched_once_per_step():
    from anvil_fast.parallel.comms import LocalComms

    class Counting(LocalComms):
        calls = 0

        def reduce_scatter_avg(self, out, inp):
            Counting.calls += 1
            return super().reduce_scatter_avg(out, inp)

    model = BG.BankedGPT(SIZES["tiny"], group_layers=1)
    opt = OV.make_optimizer(model, comms=Counting(), compile_banks=False)
    TS.train(model, opt, mode="prehook", steps=2, world=1, rank=0, **KW)
    # one process: only the banks' reduces reach the comms (a copy into the bank's buffer); 4 banks
    assert Counting.calls == 2 * 4


def test_accumulation_arms_the_last_micro_batch_only():
    cfg = SIZES["tiny"]
    x, y = BG.batch(cfg, step=0, global_batch=2, seq=16, world=1, rank=0, device="cpu")
    model = BG.BankedGPT(cfg, group_layers=1)
    opt = OV.make_optimizer(model, compile_banks=False)
    driver = OV.OverlappedStep(opt, model, wait="end")
    with pytest.raises(RuntimeError, match="without begin"):
        driver.step()
    model(x, y).backward()  # an earlier micro-batch: nothing launched
    assert driver._launched == {}
    driver.begin()
    model(x, y).backward()
    assert len(driver._launched) == 4 + 3  # 4 banks, lm_head, pos, embed: every sharded label
    with pytest.raises(RuntimeError, match="second gradient after begin"):
        model(x, y).backward()


def test_the_step_rule_is_the_optimizers():
    # which gradients a step reads and which it keeps: AnvilAndAdam's rule, which every driver uses
    import inspect

    model = BG.BankedGPT(SIZES["tiny"], group_layers=1)
    opt = OV.make_optimizer(model, compile_banks=False)
    banks = [l for l in opt.labels if opt.param_cfgs[l].optim == "anvil"]
    assert opt.step_labels(False) == banks and opt.step_labels(True) == list(opt.labels)
    x, y = BG.batch(model.cfg, step=0, global_batch=2, seq=16, world=1, rank=0, device="cpu")
    model(x, y).backward()
    OV.sequential_step(opt, do_adam=False)
    assert all((opt.params[l].grad is None) == (l in banks) for l in opt.labels)  # Adam's kept
    for fn in (OV.OverlappedStep.begin, OV.OverlappedStep.step, OV.sequential_step):
        src = inspect.getsource(fn)
        assert 'optim == "anvil"' not in src and ("step_labels" in src or "step_grads" in src), fn


def test_the_library_parts_live_outside_the_cli_module():
    from pathlib import Path

    import anvil_fast

    root = Path(anvil_fast.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "train_step.py":
            continue
        src = path.read_text()
        assert "train_step import" not in src and "import anvil_fast.studies.train_step" not in src, path
    # the model module needs no optimizer
    assert "optimizer" not in "".join(l for l in (root / "models" / "banked_gpt.py").read_text().splitlines(True)
                                      if l.startswith(("import", "from")))
