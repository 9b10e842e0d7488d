"""``python -m anvil_fast.bench peers``: the harness's numbers on fake contenders whose answers are known
(a polar factor's spread is 1 / 1 / 1, a prescribed spectrum's spread is written out here), the
gradients it hands every step, the box that kills a process group, the run order and its gates, the
tables, the README's generated speed sentence, and one CPU run end to end with fake peers that are
missing, need CUDA, raise and hang. No timing of a real optimizer is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from anvil_fast.bench import COMMANDS
from anvil_fast.bench import peers as P
from tests.helpers import cuda_block_bound

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
LR = 0.01
#: fp32 storage of a change computed in float64 moves each entry by at most 2**-24 of itself, so the
#: spectrum by at most 2**-24 * ||delta||_F = 2**-24 * sqrt(k) * rms (Weyl); the ratios to the RMS
#: (itself off by as much) then by at most twice that, and a max ratio of 3 (the prescribed
#: spectrum) by 3 times that again: 8 * 2**-24 * sqrt(k) covers both.
def spread_bound(k: int) -> float:
    return 8 * 2.0 ** -24 * math.sqrt(k)


class _SVDStep:
    """Replaces each probed matrix's value by ``W - LR * U diag(d(k)) V^T`` from the SVD of its
    gradient (float64), ``d`` given by ``spectrum``; leaves every other parameter alone."""

    def __init__(self, model, spectrum):
        self.named = dict(model.named_parameters())
        self.spectrum = spectrum

    @torch.no_grad()
    def step(self):
        for full in P.PROBES.values():
            p = self.named[full]
            u, s, vh = torch.linalg.svd(p.grad.double(), full_matrices=False)
            d = self.spectrum(s.numel()).to(torch.float64)
            p.sub_((LR * (u * d) @ vh).float())


def _ones(k):
    return torch.ones(k)


def _linspace_desc(k):
    return torch.linspace(3.0, 1.0, k)


def test_peers_is_registered():
    assert COMMANDS["peers"] == ".peers"


def test_a_polar_factor_gives_a_spread_of_one():
    c = P.Contender("fake_polar", "polar", "peer", lambda m, d, w: _SVDStep(m, _ones))
    row = P.measure(c, "smoke", CPU, warmup=1, steps=2)
    for short, full in P.PROBES.items():
        shape = dict(P.build_model("smoke", CPU).named_parameters())[full].shape
        bound = spread_bound(min(shape))
        s = row["spread"][short]
        assert abs(s["min"] - 1) < bound and abs(s["mean"] - 1) < bound and abs(s["max"] - 1) < bound, (short, s)


def test_a_prescribed_spectrum_gives_its_spread():
    c = P.Contender("fake_shaped", "shaped", "peer", lambda m, d, w: _SVDStep(m, _linspace_desc))
    row = P.measure(c, "smoke", CPU, warmup=1, steps=1)
    named = dict(P.build_model("smoke", CPU).named_parameters())
    for short, full in P.PROBES.items():
        k = min(named[full].shape)
        d = np.linspace(3.0, 1.0, k)
        rms = math.sqrt(float(np.mean(d ** 2)))
        s = row["spread"][short]
        bound = spread_bound(k)
        assert abs(s["min"] - 1.0 / rms) < bound, (short, s)
        assert abs(s["mean"] - 2.0 / rms) < bound, (short, s)  # the mean of an even linspace from 1 to 3
        assert abs(s["max"] - 3.0 / rms) < bound, (short, s)


def test_spread_of_a_written_out_matrix():
    s = P.spread_of(torch.diag(torch.tensor([1.0, 2.0, 2.0])))
    rms = math.sqrt((1 + 4 + 4) / 3)
    assert s["min"] == pytest.approx(1 / rms, rel=1e-12)
    assert s["mean"] == pytest.approx(5 / 3 / rms, rel=1e-12)
    assert s["max"] == pytest.approx(2 / rms, rel=1e-12)
    assert P.spread_of(torch.zeros(3, 4)) is None


def test_a_step_that_changes_nothing_says_so():
    class Idle:
        def step(self):
            pass

    row = P.measure(P.Contender("idle", "idle", "peer", lambda m, d, w: Idle()), "smoke", CPU, warmup=1, steps=1)
    assert row["spread"] == {short: "no change on the first step" for short in P.PROBES}


def test_every_step_sees_the_fixed_gradient():
    """A contender that spoils the gradient it was handed (one parameter's in place, the next one's
    cleared, as heavyball clears them) still finds the same gradient at every step."""
    seen = {"steps": 0}

    class Spoiler:
        def __init__(self, model):
            self.params = list(model.parameters())
            self.first = None

        def step(self):
            grads = [p.grad for p in self.params]
            assert all(g is not None for g in grads), "a cleared gradient was not handed back"
            if self.first is None:
                self.first = [g.clone() for g in grads]
            for g, f in zip(grads, self.first):
                assert torch.equal(g, f), "the gradient differs from the first step's"
            for i, p in enumerate(self.params):
                if i % 2:
                    p.grad = None
                else:
                    p.grad.add_(1.0)
            seen["steps"] += 1

    P.measure(P.Contender("spoiler", "spoiler", "peer", lambda m, d, w: Spoiler(m)), "smoke", CPU, warmup=2, steps=3)
    assert seen["steps"] == 5


def test_the_timed_steps_are_the_step_calls():
    class Sleeper:
        def step(self):
            time.sleep(0.005)

    row = P.measure(P.Contender("sleeper", "s", "peer", lambda m, d, w: Sleeper()), "smoke", CPU, warmup=1, steps=4)
    assert row["steps"] == 4
    assert row["ms"] >= 5.0 and row["host_ms"] >= 5.0 and row["ms_min"] >= 5.0
    assert row["resident_mib"] is None and row["peak_mib"] is None and row["reserved_mib"] is None  # CUDA only


def test_measure_needs_a_warmup_step():
    c = P.Contender("x", "x", "peer", lambda m, d, w: None)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        P.measure(c, "smoke", CPU, warmup=0, steps=1)


def test_split_params_routes_the_blocks_matrices_to_the_matrix_optimizer():
    model = P.build_model("tiny", CPU)
    hidden, head, rest = P.split_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in hidden} == {f"blocks.{i}.{m}.weight" for i in range(2)
                                              for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert [names[id(p)] for p in head] == ["lm_head.weight"]
    assert {names[id(p)] for p in rest} == {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"} | \
        {f"blocks.{i}.{ln}.{w}" for i in range(2) for ln in ("ln1", "ln2") for w in ("weight", "bias")}


def test_the_registry_names_every_peer_once():
    names = [c.name for c in P.CONTENDERS]
    assert len(names) == len(set(names))
    assert {"anvil", "anvil_lean", "dion_graphed", "dion_compiled", "torch_muon", "pytorch_optimizer", "emerging",
            "adamw", "heavyball"} <= set(names)
    assert [c.name for c in P.CONTENDERS if c.kind == "reference"] == ["adamw"]
    assert {c.name for c in P.CONTENDERS if c.kind == "anvil"} == {"anvil", "anvil_lean"}


def test_the_plan_runs_the_last_contenders_after_all_others():
    got = P.plan(["heavyball", "anvil", "adamw"], ["small", "medium"])
    assert got == [("anvil", "small"), ("adamw", "small"), ("anvil", "medium"), ("adamw", "medium"),
                   ("heavyball", "small"), ("heavyball", "medium")]


def test_the_gate_says_why_a_contender_does_not_start(tmp_path):
    def gate(c, device=CPU, timed_out=None, left=100.0):
        return P.gate(c, device, tmp_path, timed_out=timed_out or {}, left_s=left, budget_s=240.0)[0]

    missing = P.Contender("m", "m", "peer", None, modules=("no_such_peer_module_for_the_gate",))
    assert gate(missing) == dict(status="not installed",
                                 detail=f"no module 'no_such_peer_module_for_the_gate' (and no checkout at "
                                        f"{tmp_path / 'no_such_peer_module_for_the_gate'})")
    refused = P.Contender("r", "r", "peer", None, check=lambda: "needs a keyword this build lacks")
    assert gate(refused) == dict(status="not available", detail="needs a keyword this build lacks")
    cuda = P.Contender("g", "g", "peer", None, needs_cuda=True)
    assert gate(cuda)["status"] == "needs CUDA"
    plain = P.Contender("p", "p", "peer", None)
    assert gate(plain, timed_out={"p": "small"}) == dict(status="skipped", detail="timed out at small")
    assert gate(plain, left=0.5) == dict(status="not run", detail="the run's budget of 240 s was spent")
    assert gate(plain) is None


def test_a_checkout_in_the_peers_dir_is_found(tmp_path):
    pkg = tmp_path / "fakepeerpkg_for_locate" / "fakepeerpkg_for_locate"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    c = P.Contender("f", "f", "peer", None, modules=("fakepeerpkg_for_locate",))
    reason, source, paths = P.locate(c, tmp_path)
    assert reason is None and paths == [str((tmp_path / "fakepeerpkg_for_locate").resolve())]
    assert "source tree" in source and "sha256" in source


def _wait_gone(pid: int, seconds: float = 5.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``seconds``."""
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_the_box_kills_the_process_and_its_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(60)")
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        rc, wall = P.run_boxed([sys.executable, "-c", script], box_s=2.0, log=log)
    assert rc is None and 2.0 <= wall < 20.0 and time.monotonic() - t0 < 20.0
    assert _wait_gone(int(pid_file.read_text()))


def test_run_boxed_returns_the_exit_code(tmp_path):
    with open(tmp_path / "log", "w") as log:
        rc, _ = P.run_boxed([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], box_s=30.0, log=log)
    assert rc == 3 and "hi" in (tmp_path / "log").read_text()


def _data(rows, sizes=("small", "medium")):
    return dict(command="python -m anvil_fast.bench peers", environment=dict(device="NVIDIA H200", torch="2.11.0",
                                                                             triton="3.6.0", python="3.12.3"),
                settings=dict(sizes=list(sizes), warmup=15, steps=50, box_s=120.0, budget_s=240.0), rows=rows)


def _row(size, name, kind, status="ok", ms=None, **kw):
    return dict(size=size, contender=name, label=f"label of {name}", kind=kind, status=status, ms=ms, **kw)


ROWS = [_row("small", "anvil", "anvil", ms=1.5, host_ms=1.2), _row("small", "dion_graphed", "peer", ms=0.5),
        _row("small", "torch_muon", "peer", ms=10.0), _row("small", "adamw", "reference", ms=0.2),
        _row("small", "heavyball", "peer", status="timeout",
             detail="did not finish within 120 s (in: warm-up step 1 of 15)"),
        _row("medium", "anvil", "anvil", ms=4.0), _row("medium", "dion_graphed", "peer", ms=5.0),
        _row("medium", "pytorch_optimizer", "peer", ms=4.5)]


def test_the_fastest_peer_is_a_peer_that_ran():
    best = P.fastest_peers(ROWS)
    assert best == {"small": dict(contender="dion_graphed", label="label of dion_graphed", ms=0.5),
                    "medium": dict(contender="pytorch_optimizer", label="label of pytorch_optimizer", ms=4.5)}


def test_the_tables_give_each_time_over_the_fastest_peer():
    md = P.render_markdown(_data(ROWS))
    assert md.startswith("<!-- generated by")
    assert "| label of anvil | 1.500 | 3.00 |  |  | 1.200 |" in md       # 1.5 / 0.5; no host-ahead time
    assert "| label of adamw | 0.200 | 0.40 |" in md               # a reference: faster, yet no peer
    assert "| label of anvil | 4.000 | 0.89 |" in md               # 4.0 / 4.5
    assert "| timeout: did not finish within 120 s (in: warm-up step 1 of 15) |" in md
    assert "Fastest peer: label of dion_graphed, 0.500 ms/step." in md


def test_the_held_column_appears_with_runs_that_measured_it():
    """Runs that measured the memory an optimizer keeps from other allocations get a "held MiB" column,
    each row's cell in it, and the method says what it is; runs stored without it keep their table."""
    rows = [_row("small", "anvil", "anvil", ms=1.5, resident_mib=86.0, peak_mib=86.0, reserved_mib=482.0,
                 held_mib=120.5),
            _row("small", "dion_graphed", "peer", ms=0.5, resident_mib=106.8, peak_mib=106.8, reserved_mib=198.0,
                 held_mib=190.25),
            _row("small", "heavyball", "peer", status="timeout", detail="did not finish")]
    md = P.render_markdown(_data(rows, sizes=("small",)))
    header = next(line for line in md.splitlines() if line.startswith("| contender |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[cols.index("reserved MiB") + 1] == "held MiB", header
    sep = md.splitlines()[md.splitlines().index(header) + 1]
    assert sep.count("|") == header.count("|"), (header, sep)
    for label, cell in (("label of anvil", "120.5"), ("label of dion_graphed", "190.2"), ("label of heavyball", "")):
        line = next(x for x in md.splitlines() if x.startswith(f"| {label} |"))
        assert [c.strip() for c in line.strip("|").split("|")][cols.index("held MiB")] == cell, line
        assert line.count("|") == header.count("|"), line
    assert "held: `memory_reserved` after the timed steps and `torch.cuda.empty_cache()`" in md
    old = P.render_markdown(_data(ROWS))
    assert "held MiB" not in old and "held:" not in old


def test_the_readme_sentence_quotes_the_fastest_peer():
    got = P.readme_sentence(_data(ROWS))
    assert got == ("Measured on one NVIDIA H200 (torch 2.11.0, `results/h200_peers/`, `python -m anvil_fast.bench "
                   "peers`): on the small GPT the drop-in's step (`anvil_fast.ANVIL`, defaults) takes 1.500 ms; the "
                   "fastest peer measured beside it, label of dion_graphed, 0.500 ms (3.00x ANVIL's time over the "
                   "peer's); not timed in that run: label of heavyball (timeout); on the medium GPT the drop-in's step (`anvil_fast.ANVIL`, defaults) takes 4.000 ms; the "
                   "fastest peer measured beside it, label of pytorch_optimizer, 4.500 ms (0.89x ANVIL's time over "
                   "the peer's).")
    no_anvil = P.readme_sentence(_data([r for r in ROWS if r["contender"] != "anvil"], sizes=("small",)))
    assert "on the small GPT the drop-in's step did not run; the fastest peer measured beside it, label of " \
           "dion_graphed, 0.500 ms; not timed in that run: label of heavyball (timeout)." in no_anvil



def test_the_host_ahead_column_has_its_own_fastest_peer_and_sentence():
    rows = [_row("small", "anvil", "anvil", ms=1.5, ms_ahead=0.6, host_ms=1.2),
            _row("small", "dion_graphed", "peer", ms=0.7, ms_ahead=0.65),
            _row("small", "torch_muon", "peer", ms=10.0, ms_ahead=0.5),
            _row("small", "pytorch_optimizer", "peer", ms=0.2)]          # no host-ahead time: not ranked there
    assert P.fastest_peers(rows)["small"]["contender"] == "pytorch_optimizer"
    ahead = P.fastest_peers(rows, "ms_ahead")["small"]
    assert (ahead["contender"], ahead["ms"]) == ("torch_muon", 0.5)
    data = dict(settings=dict(sizes=["small"], warmup=1, steps=2, box_s=1, budget_s=2), rows=rows, command="c",
                environment=dict(device="dev"))
    md = P.render_markdown(data)
    anvil_line = next(line for line in md.splitlines() if line.startswith("| label of anvil |"))
    assert "| 1.500 | 7.50 | 0.600 | 1.20 |" in anvil_line, anvil_line
    assert "Fastest peer, host ahead: label of torch_muon, 0.500 ms/step." in md
    got = P.readme_sentence(data)
    assert ("with the host ahead of the device (the step queued behind other device work, as after a backward "
            "pass) 0.600 ms, the fastest peer label of torch_muon, 0.500 ms (1.20x)") in got, got

def test_rewrite_readme_replaces_only_the_marked_sentence(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{P.README_BEGIN}\nold words\n{P.README_END}\nafter\n")
    assert P.rewrite_readme(readme, _data(ROWS))
    assert readme.read_text() == f"before\n{P.readme_block(_data(ROWS))}\nafter\n"
    assert not P.rewrite_readme(readme, _data(ROWS))
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="no speed-sentence markers"):
        P.rewrite_readme(readme, None)


def test_each_size_is_quoted_from_a_run_that_timed_the_drop_in_and_a_peer():
    cut_short = [r for r in ROWS if r["size"] == "small"] + [
        _row("medium", "anvil", "anvil", ms=4.0), _row("medium", "dion_graphed", "peer", status="not run",
                                                      detail="the run's budget of 230 s was spent")]
    medium = [_row("medium", "anvil", "anvil", ms=3.0), _row("medium", "dion_graphed", "peer", ms=4.2)]
    got = P.readme_sentence([(_data(cut_short), "a/"), (_data(medium, sizes=("medium",)), "b/")])
    assert got.startswith("Measured on one NVIDIA H200 (torch 2.11.0, each size's times from one run, in the folder "
                          "named, `python -m anvil_fast.bench peers`): on the small GPT (`a/`) the drop-in's step")
    assert "on the medium GPT (`b/`) the drop-in's step (`anvil_fast.ANVIL`, defaults) takes 3.000 ms; the fastest " \
           "peer measured beside it, label of dion_graphed, 4.200 ms (0.71x ANVIL's time over the peer's)." in got
    # with no run that timed both, the first run holding the size is quoted as it is
    alone = P.readme_sentence([(_data(cut_short), "a/")])
    assert "on the medium GPT the drop-in's step (`anvil_fast.ANVIL`, defaults) takes 4.000 ms; no peer ran; not " \
           "timed in that run: label of dion_graphed (not run)." in alone


def test_the_readme_speed_sentence_is_generated_from_the_stored_runs():
    """The README's sentence is what the stored H200 JSONs give (the placeholder while none is stored):
    the command in :data:`~anvil_fast.bench.peers.README_BEGIN` rewrites it."""
    runs = P.stored_runs(ROOT)
    reps = P.stored_runs(ROOT, P.RESULTS_REPEATS)
    assert P.readme_block(runs or None, repeats=reps) in (ROOT / "README.md").read_text()
    assert " ".join(f"--from {p}" for p in P.RESULTS_JSONS) in P.README_BEGIN
    assert " ".join(f"--repeat {p}" for p in P.RESULTS_REPEATS) in P.README_BEGIN


def test_the_repeated_runs_are_quoted_as_ranges_of_each_run_s_own_times():
    def run(anvil_ms, peer_ms, anvil_ahead, peer_ahead, anvil_status="ok"):
        rows = [dict(r) for r in ROWS if r["size"] == "small"]
        for r in rows:
            if r["contender"] == "anvil":
                r.update(ms=anvil_ms, ms_ahead=anvil_ahead, status=anvil_status)
            elif r.get("kind") == "peer" and r["status"] == "ok":
                r.update(ms=peer_ms, ms_ahead=peer_ahead)
        return _data(rows, sizes=("small",))

    reps = [(run(0.7, 0.65, 0.5, 0.6), "x/run1/"), (run(0.5, 0.66, 0.49, 0.6), "x/run2/"),
            (run(9.0, 0.64, 9.0, 0.61, "timeout"), "x/run3/")]
    got = P.repeats_clause(reps)
    assert got.startswith(" The same command repeated 3 times in a row, every contender in a fresh process each "
                          "time (`x/`): on the small GPT the drop-in's step took 0.500-0.700 ms from idle against "
                          "the fastest peer's 0.640-0.660 ms, and 0.490-0.500 ms with the host ahead against "
                          "0.600-0.610 ms (")
    assert got.endswith("; the drop-in ran in 2 of the 3 runs).")  # the timed-out run's time is not quoted
    assert P.repeats_clause([]) == ""
    assert P.readme_sentence(_data(ROWS), repeats=reps).endswith(got)
    # times that print alike are one figure, not a range of two equal ends
    close = P.repeats_clause([(run(0.4931, 0.6491, 0.3928, 0.6502), "x/run1/"),
                              (run(0.4934, 0.6494, 0.3931, 0.6498), "x/run2/")])
    assert "took 0.493 ms from idle against the fastest peer's 0.649 ms, and 0.393 ms with the host ahead " \
           "against 0.650 ms (" in close


@pytest.mark.parametrize("stored", P.RESULTS_JSONS)
def test_the_stored_tables_are_the_stored_json_rendered(stored):
    stored = ROOT / stored
    if not stored.exists():
        pytest.skip(f"no {stored} stored yet")
    assert (stored.parent / "peers.md").read_text() == P.render_markdown(json.loads(stored.read_text()))


def test_the_cli_renders_one_run_and_quotes_several(tmp_path, capsys):
    from anvil_fast.bench import main

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_data(ROWS)))
    b.write_text(json.dumps(_data(ROWS)))
    assert main(["peers", "--from", str(a), "--from", str(b)]) == 2
    assert "give one JSON" in capsys.readouterr().err
    readme = tmp_path / "README.md"
    readme.write_text(f"{P.README_BEGIN}\nold\n{P.README_END}\n")
    assert main(["peers", "--readme", str(readme), "--from", str(a), "--from", str(b)]) == 0
    assert P.readme_sentence([(_data(ROWS), f"{tmp_path.as_posix()}/")] * 2) in readme.read_text()


def test_bad_contender_names_are_refused(capsys):
    from anvil_fast.bench import main

    assert main(["peers", "--device", "cpu", "--contenders", "anvil,nope", "--out", "/nonexistent/never"]) == 2
    err = capsys.readouterr().err
    assert "error: --contenders: unknown 'nope'; expected a comma-separated subset of: anvil," in err


def test_a_negative_box_is_refused(capsys):
    from anvil_fast.bench import main

    with pytest.raises(SystemExit) as e:
        main(["peers", "--box-s", "-1"])
    assert e.value.code == 2
    assert "expected a positive number of seconds, got '-1'" in capsys.readouterr().err


FAKES = textwrap.dedent('''
    """Fake peers for tests/test_bench_peers.py (written there into a temporary folder)."""
    import time

    import torch

    from anvil_fast.bench.peers import PROBES, Contender


    class Polar:
        def __init__(self, model):
            self.named = dict(model.named_parameters())

        @torch.no_grad()
        def step(self):
            for full in PROBES.values():
                p = self.named[full]
                u, s, vh = torch.linalg.svd(p.grad.double(), full_matrices=False)
                p.sub_((0.01 * u @ vh).float())


    class Raises:
        """Changes nothing on its first step, raises on its second."""

        def __init__(self):
            self.calls = 0

        def step(self):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("the fake peer's step failed on purpose")


    HANG_BOX_S = 6.0


    class Hangs:
        def step(self):
            time.sleep(3600)


    CONTENDERS = [
        Contender("fake_missing", "a peer that is not installed", "peer", None,
                  modules=("no_such_peer_module_for_the_test",)),
        Contender("fake_cuda", "a peer that needs CUDA", "peer", None, needs_cuda=True),
        Contender("fake_polar", "a polar-factor peer", "peer", lambda m, d, w: Polar(m)),
        Contender("fake_raises", "a peer that raises", "peer", lambda m, d, w: Raises()),
        Contender("fake_hangs", "a peer that hangs", "peer", lambda m, d, w: Hangs(), last=True, box_s=HANG_BOX_S),
    ]
''')


@pytest.mark.slow
def test_cpu_run_end_to_end_with_fake_peers(tmp_path):
    (tmp_path / "fake_peers_for_the_test.py").write_text(FAKES)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    box = 90  # the box of every process but the hanging one's (6 s, its own): a loaded CI machine can take
    # tens of seconds to start a process that imports torch
    proc = subprocess.run([sys.executable, "-m", "anvil_fast.bench", "peers", "--device", "cpu", "--no-progress",
                           "--plugin", "fake_peers_for_the_test", "--peers-dir", str(tmp_path / "none"),
                           "--contenders", "fake_hangs,fake_missing,fake_cuda,fake_polar,fake_raises,dion_graphed",
                           "--warmup", "2", "--steps", "2", "--box-s", str(box), "--out", str(out),
                           "--note", "a test run"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "peers.json").read_text())
    rows = {r["contender"]: r for r in data["rows"]}
    # the order: the last-marked one after every other
    assert [r["contender"] for r in data["rows"]] == ["fake_missing", "fake_cuda", "fake_polar", "fake_raises",
                                                      "dion_graphed", "fake_hangs"]
    assert rows["fake_missing"]["status"] == "not installed"
    assert rows["fake_cuda"]["status"] == "needs CUDA"
    assert rows["dion_graphed"]["status"] == "not installed"
    assert rows["fake_polar"]["status"] == "ok" and rows["fake_polar"]["ms"] > 0 and rows["fake_polar"]["steps"] == 2
    assert data["environment"]["torch"] == torch.__version__ and "environment" not in rows["fake_polar"]
    for short in P.PROBES:  # the polar factor's 1 / 1 / 1 (bound: test_a_polar_factor_gives_a_spread_of_one)
        for k in ("min", "mean", "max"):
            assert abs(rows["fake_polar"]["spread"][short][k] - 1.0) < 1e-5, rows["fake_polar"]["spread"]
    assert rows["fake_raises"]["status"] == "error"
    assert rows["fake_raises"]["detail"] == "RuntimeError: the fake peer's step failed on purpose"
    # what was measured before the failure stays: the first step's (empty) change
    assert rows["fake_raises"]["spread"] == {short: "no change on the first step" for short in P.PROBES}
    assert rows["fake_hangs"]["status"] == "timeout"
    # where the box ran out depends on how fast the process started: the stage is named, whichever it was
    assert rows["fake_hangs"]["detail"].startswith("did not finish within 6 s (in: "), rows["fake_hangs"]
    assert 6.0 <= rows["fake_hangs"]["wall_s"] < 6.0 + 10
    md = (out / "peers.md").read_text()
    assert md == P.render_markdown(data)
    assert "| a peer that raises |" in md and "error: RuntimeError: the fake peer's step failed on purpose |" in md
    assert "Fastest peer: a polar-factor peer," in md
    assert proc.stdout.count("## smoke GPT") == 1
    command = (out / "command.txt").read_text()
    assert command.startswith("a test run\npython -m anvil_fast.bench peers --device cpu")
    log = (out / "peers.log").read_text()
    assert "RuntimeError: the fake peer's step failed on purpose" in log and "===== fake_hangs-smoke" in log


def test_the_smoke_gpt_is_the_dropin_benchmarks():
    from anvil_fast.bench.dropin import SMOKE

    assert P.build_model("smoke", CPU).cfg == SMOKE


def test_a_process_that_does_not_exit_after_its_result_is_killed_after_the_grace(tmp_path):
    flag = tmp_path / "done"
    script = f"import time; open({str(flag)!r}, 'w').write('1'); time.sleep(60)"
    with open(tmp_path / "log", "w") as log:
        rc, wall = P.run_boxed([sys.executable, "-c", script], box_s=50.0, log=log, done=flag.exists, grace_s=1.0)
    assert rc is None and wall < 20.0


def test_a_long_log_keeps_its_first_and_last_lines():
    text = "".join(f"line {i}\n" for i in range(10))
    assert P.capped(text, head=2, tail=3) == "line 0\nline 1\n[... 5 lines left out ...]\nline 7\nline 8\nline 9\n"
    assert P.capped("a\nb", head=2, tail=3) == "a\nb\n"


@pytest.mark.gpu
def test_gpu_run_reads_the_memory_counters(tmp_path):
    """The CUDA-only columns on two quick contenders. Fused AdamW's resident state is its two moments,
    8 B per parameter, and a 4 B step tensor per parameter tensor, each allocation as the caching
    allocator rounds it (:func:`helpers.cuda_block_bound`: 512 B, and up to 1 MiB of an unsplit
    block past 1 MiB)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "anvil_fast.bench", "peers", "--sizes", "small", "--no-progress",
                           "--contenders", "torch_muon,adamw", "--warmup", "3", "--steps", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["contender"]: r for r in json.loads((out / "peers.json").read_text())["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    model = P.build_model("small", CPU)
    n = sum(p.numel() for p in model.parameters())
    adamw = rows["adamw"]
    bound = sum(2 * cuda_block_bound(4 * p.numel()) + cuda_block_bound(4) for p in model.parameters())
    assert 8 * n <= adamw["resident_mib"] * P.MIB <= bound, (adamw, 8 * n, bound)
    for r in rows.values():
        assert r["ms"] > 0 and r["host_ms"] > 0
        assert r["peak_mib"] >= r["resident_mib"] >= 0 and r["reserved_mib"] >= 0
        # held: the reserved memory empty_cache could not return, over the baseline's live tensors; the
        # state the step keeps is in it
        assert r["held_mib"] >= r["resident_mib"], r
        assert all(isinstance(s, dict) and math.isfinite(s["max"]) for s in r["spread"].values()), r["spread"]
    assert adamw["held_mib"] * P.MIB >= 8 * n, adamw


def test_a_bf16_size_is_the_same_model_in_bf16_parameters_and_the_drop_in_steps_it():
    import argparse

    from anvil_fast.models import gpt

    full, half = P.build_model("tiny", CPU), P.build_model("tiny-bf16", CPU)
    for (n, a), (m, b) in zip(full.named_parameters(), half.named_parameters()):
        assert n == m and b.dtype == torch.bfloat16 and torch.equal(a.detach().bfloat16(), b.detach()), n
    ap = argparse.ArgumentParser()
    P.add_args(ap)
    assert ap.parse_args(["--sizes", "small-bf16,gpt2medium"]).sizes == ["small-bf16", "gpt2medium"]
    with pytest.raises(ValueError, match="unknown GPT size 'tiny-fp8'"):
        gpt.build("tiny-fp8")
    from anvil_fast.optim.entry import ANVIL

    params = list(half.parameters())
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, P.fixed_gradients(params, CPU)):
        p.grad = g
    ANVIL(half).step()
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in params)
    assert sum(not torch.equal(p, b) for p, b in zip(params, before)) == len(params)
