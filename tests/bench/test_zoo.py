"""bench/zoo.py on the CPU: every zoo architecture, at a tiny size, trains bit-exact through a plan
of storm.enable; the zoo's cells, caps, duels and resumption on made-up measurements; its verdicts
on a made-up run, each failing where its numbers do; and its command line without CUDA."""

from __future__ import annotations

import argparse
import json
import random
import sys
from types import SimpleNamespace

import pytest
import torch

import storm
from helpers import bench_module, run_bench
from storm.blocks import block_lists
from storm.examples.models import same_bits

common = bench_module("common")
hf = bench_module("hf")
zoo_verdicts = bench_module("zoo_verdicts")
zoo = bench_module("zoo")
GiB, MiB = common.GiB, 1 << 20
CPU = torch.device("cpu")
STORM = {"mode": "embedded", "min_bytes": 0, "pool_size": "64MiB"}
STEPS = 6  # an offload trace, a compute trace, then planned steps (trials of two recompute forms among them)

# where storm.enable's find_blocks finds each architecture's blocks: its one list of layers, or T5's two
# (the encoder's, then the decoder's, whose blocks cross-attend too), planned as one sequence
BLOCKS_AT = {"llama": "model.layers", "mistral": "model.layers", "gemma2": "model.layers", "phi3": "model.layers",
             "gpt-neox": "gpt_neox.layers", "mixtral": "model.layers", "t5": "encoder.block + decoder.block",
             "bert": "encoder.layer"}


def train(w, enable: bool, blocks=None) -> tuple[list[tuple[torch.Tensor, dict[str, torch.Tensor]]], object]:
    """STEPS SGD steps of ``w`` from its seed, through storm.enable(model, budget=0.5) where
    ``enable`` (with blocks=``blocks(model)`` where given): each step's loss and gradients, and
    the handle."""
    model, ids = w.build(CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # dropout's masks (BERT, T5): both runs draw the same
    given = {"blocks": blocks(model)} if blocks else {}
    handle = storm.enable(model, budget=0.5, **given, **STORM) if enable else None
    steps = []
    for _ in range(STEPS):
        loss = w.objective(w.forward(model, ids))
        loss.backward()
        steps.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps, handle


def differences(plain: list, planned: list) -> list[str]:
    """Where two runs' losses or gradients differ in a single bit, step by step."""
    out = []
    for i, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(plain, planned)):
        if not same_bits(loss_a, loss_b):
            out.append(f"step {i}: loss {loss_a.item()!r} != {loss_b.item()!r}")
        if grads_a.keys() != grads_b.keys():
            out.append(f"step {i}: gradients of {sorted(grads_a.keys() ^ grads_b.keys())} on one side only")
        out += [f"step {i}: gradient of {n}" for n in grads_a if n in grads_b and not same_bits(grads_a[n], grads_b[n])]
    return out


@pytest.mark.parametrize("arch", list(hf.ARCHS))
def test_every_zoo_architecture_trains_bit_exact_through_a_plan(arch):
    w = hf.tiny(arch)
    plain, _ = train(w, enable=False)
    planned, handle = train(w, enable=True)
    try:
        assert len(plain) == len(planned) == STEPS and len(plain[0][1]) > 0
        assert differences(plain, planned) == []
        pl = handle.planner
        assert pl.plan is not None and handle.where == BLOCKS_AT[arch]
        assert pl.plan.recomputed or pl.plan.offloaded  # half the saves moved: the plan did something
    finally:
        handle.disable()


def test_t5s_two_block_lists_are_found_and_planned_as_one_bit_exact():
    """storm.enable(model, budget=0.5) on T5, no blocks= given: the encoder's and the decoder's
    lists, in the order forward runs them, and explain() names both."""
    w = hf.tiny("t5")
    plain, _ = train(w, enable=False)
    planned, handle = train(w, enable=True)
    try:
        assert differences(plain, planned) == []
        model = handle.model
        assert handle.found.lists == (("encoder.block", w.layers), ("decoder.block", w.layers))
        assert handle.blocks == [*model.encoder.block, *model.decoder.block] and handle.found.left == ()
        assert handle.planner.plan is not None and handle.planner.blocks == handle.blocks
        assert (f"storm.plan on {2 * w.layers} blocks at encoder.block + decoder.block (T5Block) on every forward "
                f"of T5ForConditionalGeneration") in handle.explain()
        assert (f"\nblocks: encoder.block ({w.layers}) + decoder.block ({w.layers}), planned as one sequence in the "
                f"order forward runs them\n") in handle.explain()
    finally:
        handle.disable()


def test_t5s_lists_given_as_blocks_train_bit_exact_as_before():
    """What a T5 user passed before both lists were found: the same blocks, named as given."""
    w = hf.tiny("t5")
    plain, _ = train(w, enable=False)
    planned, handle = train(w, enable=True, blocks=lambda m: [*m.encoder.block, *m.decoder.block])
    try:
        assert differences(plain, planned) == [] and handle.where == "blocks=" and len(handle.blocks) == 2 * w.layers
        assert handle.planner.plan is not None
    finally:
        handle.disable()


def test_t5s_full_offload_keeps_its_loss_saves_though_an_early_save_comes_back_between_them():
    """T5's labels are a view of the storage of its input ids, which the encoder's embedding saved
    first: backward unpacks that early save between the loss's own. With the allocator read (a
    fake here: a constant beside the queue and the window, and gradients that grow over
    backward's first unpacks), the steps after the profile keep the loss's
    last saves on the device, fetch the early one at its place, and train bit-exact."""
    w = hf.tiny("t5")
    plain = []
    for enable in (False, True):
        model, ids = w.build(CPU)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        handle = storm.enable(model, **STORM) if enable else None
        if handle is not None:
            session = storm.registry.session_for(STORM["mode"], None, STORM["pool_size"])
            queue, rooms = session.copy_queue, session.rooms
            allocator = queue.memory

            def reader(device: torch.device) -> int:
                gradients = (4 << 10) * min(handle.last._step.unpacked, 10)  # growing as backward goes on
                return (1 << 30) + gradients + queue.nbytes + session.restorer.prefetch.nbytes

            queue.memory = reader
        steps, kept = [], []
        try:
            for _ in range(4):
                loss = w.objective(w.forward(model, ids))
                loss.backward()
                steps.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                      if p.grad is not None}))
                if handle is not None:
                    kept.append(handle.last.stats.kept.get(storm.Keep.ROOM, 0))
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            if handle is not None:
                handle.disable()
                queue.memory, rooms.room = allocator, None
        if not enable:
            plain = steps
    assert kept[0] == 0 and min(kept[1:]) >= 2, kept  # the profile's step, then the room's
    assert differences(plain, steps) == []


def test_the_comparison_sees_a_single_bit():
    """The bit-exact test above would catch a real difference: one bit of one gradient at one step."""
    steps, _ = train(hf.tiny("llama"), enable=False)
    changed = [(loss, dict(grads)) for loss, grads in steps]
    name, g = next(iter(changed[3][1].items()))
    flipped = g.clone()
    flipped.view(-1).view(torch.int32)[0] ^= 1
    changed[3][1][name] = flipped
    assert differences(steps, changed) == [f"step 3: gradient of {name}"]
    changed[5] = (changed[5][0].nextafter(torch.tensor(1.0)), changed[5][1])
    assert differences(steps, changed)[-1].startswith("step 5: loss")


def test_the_cells_are_eight_architectures_at_two_shapes_each():
    assert len(hf.ARCHS) >= 8 and set(zoo.CELLS) == {f"{a}-{s}" for a in hf.ARCHS for s in ("wide", "long")}
    for w in zoo.CELLS.values():
        assert w.dtype == "bfloat16" and w.arch in hf.ARCHS
    assert all(zoo.CELLS[f"{a}-wide"].batch > zoo.CELLS[f"{a}-long"].batch for a in hf.ARCHS)
    assert all(zoo.CELLS[f"{a}-wide"].seq < zoo.CELLS[f"{a}-long"].seq for a in hf.ARCHS)
    assert hf.ARCHS["gemma2"].attn == "eager" and zoo.CELLS["gemma2-wide"].vocab == 256000
    assert zoo.CELLS["mistral-long"].window < zoo.CELLS["mistral-long"].seq  # its window slides there


def test_t5_has_two_block_lists_and_checkpointing_covers_both():
    w = hf.tiny("t5")
    model, ids = w.build(CPU, ckpt=True)
    assert ids.shape == (2, w.batch, w.seq)  # input_ids and the decoder's labels
    assert set(block_lists(model)) == {"encoder.block", "decoder.block"}
    assert hf.HF.blocks(model) == [*model.encoder.block, *model.decoder.block]
    assert all(b.gradient_checkpointing for b in [*model.encoder.block, *model.decoder.block])


def test_the_enable_method_trains_and_is_turned_off_at_close():
    """common.Trainer's "enable" is storm.enable(model, **opts), as zoo.py's rows and duels run it."""
    w = hf.tiny("gpt-neox")
    t = common.Trainer(w, "enable", {**STORM, "budget": 0.5}, CPU)
    model = t.model
    t.warm(3)
    assert t.planner is t.handle.planner and t.planner.plan is not None and t.last is t.handle.last
    t.close()
    assert storm.enabled.handle_of(model) is None


def test_a_duel_times_its_trainers_in_alternation_and_reads_the_plan():
    args = argparse.Namespace(warmup=1, rounds=2, round_steps=1)
    w = hf.tiny("llama")
    d = zoo.duel([(w, "enable", {**STORM, "budget": 0.5}), (w, "checkpoint", {}), (w, "none", {})], args, CPU,
                 random.Random(0))
    assert len(d["ms"]) == 3 and len(d["first_over"]) == len(d["first_over_95"]) == 2
    assert d["first_over"][0] == round(d["ms"][0] / d["ms"][1], 3) and "recomputed_blocks" in d["chosen"]
    bad = zoo.duel([(w, "enable", {**STORM, "peak": GiB})], args, CPU, random.Random(0))  # peak= needs CUDA
    assert bad["error"].startswith("ValueError")


def test_the_predicted_step_peak_is_the_besides_and_the_plans_step_peak_and_says_where_it_came_from():
    class Planner:
        plan, besides = "a plan", 100

        def step_peak(self, plan):
            return 20 if plan == "a plan" else 0

    class Before:  # the name before storm.plan made it public
        plan, besides = "a plan", 100

        def _step_peak(self, plan):
            return 30

    assert zoo.predicted_step_peak(Planner()) == (120, "planner.besides + planner.step_peak(planner.plan)")
    assert zoo.predicted_step_peak(Before())[0] == 130
    full = Planner()
    full.plan = SimpleNamespace(full=True)
    assert zoo.predicted_step_peak(full) == (None, "none: full offload's peak is its room's, measured and not "
                                                   "predicted")
    untraced = Planner()
    untraced.besides = None  # on the CPU, or before the compute trace: nothing measured to add to
    assert zoo.predicted_step_peak(untraced)[0] is None


class FakeRun:
    """common.run's results for a cell's rows, made up: the plan fits any cap down to 2 GiB."""

    PEAKS = {"none": 10.0, "checkpoint": 3.0, "save_on_cpu": 2.5, "torchtune": 2.5, "storm-enable": 2.51}
    MS = {"none": 100.0, "checkpoint": 130.0, "save_on_cpu": 900.0, "torchtune": 700.0, "storm-enable": 300.0}

    def __init__(self):
        self.calls = []

    def __call__(self, w, method, steps, warmup, opts, device, more=None):
        self.calls.append((w, method, opts))
        if isinstance(w, common.Variant):  # torchtune over checkpointing
            return {"error": "ImportError: torchtune is not installed"}
        if "peak" in opts:
            return {"step_ms": 120.0, "peak_extra_GiB": opts["peak"] / GiB - 0.01,
                    "peak_bytes": opts["peak"] - 10 * MiB, "predicted_step_peak_bytes": opts["peak"] - 20 * MiB,
                    "predicted_from": "test", "plan": {"fits": True, "full_offload": opts["peak"] < 2.6 * GiB,
                                                                "recomputed_blocks": [1], "offloaded_blocks": 0,
                                                                "inputs_offloaded_blocks": 0}}
        key = "storm-enable" if method == "enable" else method
        return {"step_ms": self.MS[key], "peak_extra_GiB": self.PEAKS[key], "peak_bytes": int(self.PEAKS[key] * GiB)}


def fake_duel(calls):
    def dueling(specs, args, device, order):
        calls.append([(method, opts.get("peak")) for _, method, opts in specs])
        return {"ms": [100.0] + [110.0] * (len(specs) - 1), "first_over": [0.909] * (len(specs) - 1),
                "first_over_95": [[0.9, 0.92]] * (len(specs) - 1), "rounds": args.rounds}
    return dueling


ARGS = argparse.Namespace(steps=1, warmup=0, rounds=3, round_steps=1, min_bytes=1024, pool_size="1GiB",
                          full_only=False, codec=None, codecs=None, caps=None)


def test_a_cell_caps_the_plan_at_every_other_peak_and_between_and_duels_the_best_other(tmp_path):
    fake, duels = FakeRun(), []
    cell, saves = {}, []
    zoo.measure_cell(hf.tiny("llama"), cell, ARGS, CPU, lambda: saves.append(1), measure_row=fake,
                     dueling=fake_duel(duels))
    ckpt, none = int(3.0 * GiB), 10 * GiB
    # save_on_cpu's and torchtune's 2.5 GiB, STORM's full offload's 2.51 (within 0.5%: one cap), checkpointing's,
    # three between it and no offload's, and no offload's
    assert [c["cap_bytes"] for c in cell["caps"]] == [int(2.5 * GiB), ckpt] + \
        [ckpt + (none - ckpt) * k // 4 for k in (1, 2, 3)] + [none]
    assert cell["caps"][0]["sources"] == ["save_on_cpu", "torchtune", "storm-enable"]
    assert [o["peak"] for _, m, o in fake.calls if "peak" in o] == [c["cap_bytes"] for c in cell["caps"]]
    assert all(o["min_bytes"] == 1024 and o["mode"] == "embedded" for _, m, o in fake.calls if m == "enable")
    failed = next(r for r in cell["rows"] if r["label"] == "torchtune-checkpoint")
    assert failed["error"].startswith("ImportError")  # recorded, and the cell went on
    # at the least cap the best other (torchtune, faster than save_on_cpu; full offload's 2.51 GiB does not fit)
    # and checkpointing, timed beside the plan; elsewhere the best other alone (checkpointing up to no offload's
    # peak, which no offload fits); then full offload against torchtune
    assert duels[0] == [("enable", int(2.5 * GiB)), ("torchtune", None), ("checkpoint", None)]
    assert [d[1][0] for d in duels[1:-1]] == ["checkpoint"] * 4 + ["none"] and all(len(d) == 2 for d in duels[1:])
    assert duels[-1] == [("enable", None), ("torchtune", None)]
    v = cell["verdicts"]
    assert v["per_cap"]["holds"] and v["least_cap"]["holds"] and v["least_cap"]["x_checkpoint"] == 0.909
    assert v["predicted_peak"]["holds"] and not v["full_offload"]["holds"]  # 0.909x torchtune: not 0.65x
    assert cell["complete"] and len(saves) >= len(cell["rows"])


def test_full_only_measures_full_offload_and_torchtune_and_their_duel_alone():
    fake, duels = FakeRun(), []
    cell = {}
    zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "full_only": True}), CPU,
                     lambda: None, measure_row=fake, dueling=fake_duel(duels))
    assert [r["label"] for r in cell["rows"]] == ["torchtune", "storm-enable"] and cell["caps"] == []
    assert duels == [[("enable", None), ("torchtune", None)]]
    assert cell["verdicts"]["full_offload"]["x_torchtune"] == 0.909 and cell["complete"]


class Pinning(FakeRun):
    """FakeRun whose torchtune and full-offload rows each take 40 GiB of ``host`` (its
    ``available``) while their trainer runs, and give it back as it closes."""

    def __init__(self, host: SimpleNamespace):
        super().__init__()
        self.host = host

    def __call__(self, w, method, steps, warmup, opts, device, more=None):
        row = super().__call__(w, method, steps, warmup, opts, device, more)
        taken = 40 * GiB * (method in ("torchtune", "enable") and "peak" not in opts)
        self.host.available -= taken
        row.update(more(SimpleNamespace(method=method, handle=None, planner=None)))
        self.host.available += taken
        return row


@pytest.mark.parametrize("available_GiB", [100, 80])
def test_a_duel_whose_methods_took_more_host_memory_than_there_is_is_recorded_not_run(available_GiB):
    host, duels, cell = SimpleNamespace(available=available_GiB * GiB), [], {}
    zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "full_only": True}), CPU,
                     lambda: None, measure_row=Pinning(host), dueling=fake_duel(duels),
                     host=lambda: host.available)
    assert [r["host_GiB"] for r in cell["rows"]] == [40.0, 40.0]  # each row's, read while its trainer held it
    if available_GiB == 100:  # 80 GiB together fit 90% of 100
        assert len(duels) == 1 and cell["verdicts"]["full_offload"]["x_torchtune"] == 0.909
    else:  # they do not fit 90% of 80: the host would have killed the process mid-duel
        assert duels == [] and cell["full_duel"]["error"].startswith("host memory: storm-enable + torchtune need 80.0")
        assert cell["complete"] and cell["verdicts"]["full_offload"]["holds"] is False
        host.available = 100 * GiB  # resumed on a larger host: the duel left out is tried again, the rows kept
        zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "full_only": True}), CPU,
                         lambda: None, measure_row=Pinning(host), dueling=fake_duel(duels),
                         host=lambda: host.available)
        assert len(duels) == 1 and cell["verdicts"]["full_offload"]["x_torchtune"] == 0.909


class KeepingPool(Pinning):
    """Pinning, whose full-offload row keeps its 40 GiB once its trainer closes, as the embedded
    store's pool stays with the process for its later stores."""

    def __call__(self, w, method, steps, warmup, opts, device, more=None):
        row = super().__call__(w, method, steps, warmup, opts, device, more)
        self.host.available -= 40 * GiB * (method == "enable" and "peak" not in opts)
        return row


def test_what_a_row_kept_is_out_of_the_available_memory_already_and_counts_once():
    """The full-offload row's pool stays (100 GiB less 40 available at the duel): the duel needs
    torchtune's 40 more alone, which fits 90% of the 60 left; counted again it would not."""
    host, duels, cell = SimpleNamespace(available=100 * GiB), [], {}
    zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "full_only": True}), CPU,
                     lambda: None, measure_row=KeepingPool(host), dueling=fake_duel(duels),
                     host=lambda: host.available)
    assert [(r["host_GiB"], r["host_kept_GiB"]) for r in cell["rows"]] == [(40.0, 0.0), (40.0, 40.0)]
    assert len(duels) == 1 and "error" not in cell["full_duel"]


def test_what_an_earlier_process_kept_counts_whole_on_resume():
    """A first call measures the rows (the full-offload row keeps its pool) and is cut off before
    the duel; the resumed call is another process, which holds no pool: the duel needs both rows'
    40 GiB again, over 90% of the 80 available, and is not run."""
    args = argparse.Namespace(**{**vars(ARGS), "full_only": True})
    host, cell = SimpleNamespace(available=100 * GiB), {}

    def cut_off(*_: object) -> dict:
        raise KeyboardInterrupt  # the call's time ran out

    with pytest.raises(KeyboardInterrupt):
        zoo.measure_cell(hf.tiny("llama"), cell, args, CPU, lambda: None, measure_row=KeepingPool(host),
                         dueling=cut_off, host=lambda: host.available, process="first")
    assert [r["host_kept_GiB"] for r in cell["rows"]] == [0.0, 40.0]
    again, duels = SimpleNamespace(available=80 * GiB), []
    zoo.measure_cell(hf.tiny("llama"), cell, args, CPU, lambda: None, measure_row=KeepingPool(again),
                     dueling=fake_duel(duels), host=lambda: again.available, process="second")
    assert duels == [] and cell["full_duel"]["host_short"]
    assert cell["full_duel"]["error"].startswith("host memory: storm-enable + torchtune need 80.0 GiB")
    assert "over the 90% of the 80.0 GiB available" in cell["full_duel"]["error"]


def test_a_resumed_duel_counts_what_a_rows_process_had_kept_before_it():
    """t5-long's least-cap plan grew the pool its full-offload row had left the first process
    (it took 12.9 GiB more, over 50.6 kept); resumed, a fresh process would grow it from nothing,
    and the duel beside save_on_cpu took the host. Each row records what its process had kept
    before it began, and a resumed duel counts it with the row."""
    args = argparse.Namespace(**{**vars(ARGS), "full_only": True})
    host, first = SimpleNamespace(available=200 * GiB), {}
    zoo.measure_cell(hf.tiny("llama"), first, args, CPU, lambda: None, measure_row=KeepingPool(host),
                     dueling=fake_duel([]), host=lambda: host.available, process="kept-first")
    assert [r["host_held_GiB"] for r in first["rows"]] == [0.0, 0.0]  # nothing kept before them
    second = {}  # another cell in the same process: its rows begin over the 40 GiB pool
    zoo.measure_cell(hf.tiny("llama"), second, args, CPU, lambda: None, measure_row=KeepingPool(host),
                     dueling=fake_duel([]), host=lambda: host.available, process="kept-first")
    assert [r["host_held_GiB"] for r in second["rows"]] == [40.0, 40.0]
    rows = second["rows"]  # 40 GiB each, run from over 40 kept: 160 GiB in a fresh process, 40 in this one
    assert zoo.host_short(rows, 150 * GiB, "kept-later").startswith("host memory: torchtune + storm-enable need 160.0")
    assert zoo.host_short(rows, 50 * GiB, "kept-first") is None


def test_a_row_that_freed_host_memory_as_it_ran_takes_nothing_from_the_others():
    rows = [{"label": "a", "host_GiB": 80.0}, {"label": "b", "host_GiB": -30.0}, {"label": "c"}]
    assert zoo.host_short(rows, 80 * GiB).startswith("host memory: a + b + c need 80.0 GiB")
    assert zoo.host_short(rows, 100 * GiB) is None and zoo.host_short(rows, None) is None
    kept = [{**rows[0], "host_kept_GiB": 30.0, "process": "this"}, {**rows[1], "host_kept_GiB": -5.0}, rows[2]]
    assert zoo.host_short(kept, 60 * GiB, "this") is None  # 50 GiB more: a's 30 kept is out of the 60 already
    assert zoo.host_short(kept, 50 * GiB, "this").startswith("host memory: a + b + c need 50.0 GiB")
    assert zoo.host_short(kept, 60 * GiB, "another").startswith("host memory: a + b + c need 80.0 GiB")


def test_a_codec_given_goes_to_every_storm_row_and_none_leaves_storms_default():
    fake = FakeRun()
    zoo.measure_cell(hf.tiny("llama"), {}, argparse.Namespace(**{**vars(ARGS), "full_only": True, "codec": "auto"}),
                     CPU, lambda: None, measure_row=fake, dueling=fake_duel([]))
    assert [opts.get("codec") for _, method, opts in fake.calls if method == "enable"] == ["auto"]
    fake = FakeRun()
    zoo.measure_cell(hf.tiny("llama"), {}, argparse.Namespace(**{**vars(ARGS), "full_only": True}), CPU,
                     lambda: None, measure_row=fake, dueling=fake_duel([]))
    assert all("codec" not in opts for _, method, opts in fake.calls if method == "enable")


def test_codecs_measure_full_offload_in_each_and_time_them_against_each_other_alone():
    fake, duels = FakeRun(), []
    cell: dict = {}
    zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "codecs": ["raw", "auto"]}), CPU,
                     lambda: None, measure_row=fake, dueling=fake_duel(duels))
    assert [(m, o.get("codec")) for _, m, o in fake.calls] == [("enable", "raw"), ("enable", "auto")]
    assert [r["label"] for r in cell["rows"]] == ["storm-enable codec=raw", "storm-enable codec=auto"]
    assert cell["caps"] == [] and duels == [[("enable", None), ("enable", None)]]
    assert cell["codec_duel"]["versus"] == ["storm-enable codec=auto"] and cell["codec_duel"]["first_over"] == [0.909]
    assert "storm-enable codec=auto 0.909x" in zoo_verdicts.table("llama-tiny", cell)


def test_caps_measure_the_plan_at_each_alone_least_first_and_hold_it_to_no_other():
    fake, duels = FakeRun(), []
    cell: dict = {}
    zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "caps": [3.0, 2.5]}), CPU,
                     lambda: None, measure_row=fake, dueling=fake_duel(duels))
    assert [o["peak"] for _, m, o in fake.calls] == [int(2.5 * GiB), int(3.0 * GiB)] and duels == []
    assert [r["label"] for r in cell["rows"]] == [zoo.plan_label(int(2.5 * GiB)), zoo.plan_label(int(3.0 * GiB))]
    v = cell["verdicts"]
    assert v["least_cap"]["cap_GiB"] == 2.5 and v["per_cap"]["holds"] is None
    assert [c["holds"] for c in v["per_cap"]["caps"]] == [None, None] and all(c["fits"] for c in v["per_cap"]["caps"])
    text = zoo_verdicts.table("llama-tiny", cell)
    assert "2.5 GiB (--caps): plan 2.49 GiB fits" in text and "full offload (no plan of the blocks" in text
    assert "n/a (no other method measured)" in text and "FAILS" not in text.split("per_cap")[0]


def test_a_cell_is_resumed_only_by_a_run_of_its_own_kind():
    cell: dict = {}
    zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "full_only": True}), CPU,
                     lambda: None, measure_row=FakeRun(), dueling=fake_duel([]))
    assert cell["mode"] == "full-only"
    with pytest.raises(SystemExit, match="was measured as a full-only run in this --out"):
        zoo.measure_cell(hf.tiny("llama"), cell, argparse.Namespace(**{**vars(ARGS), "caps": [2.5]}), CPU,
                         lambda: None, measure_row=FakeRun(), dueling=fake_duel([]))
    assert [r["label"] for r in cell["rows"]] == ["torchtune", "storm-enable"]  # nothing of it lost


def test_resuming_a_cut_off_cell_keeps_its_rows_and_duels():
    fake, duels = FakeRun(), []
    cell = {}
    zoo.measure_cell(hf.tiny("llama"), cell, ARGS, CPU, lambda: None, measure_row=fake, dueling=fake_duel(duels))
    del cell["rows"][-2:], cell["full_duel"], cell["complete"]  # as if cut off in the last plan rows
    again, more = FakeRun(), []
    zoo.measure_cell(hf.tiny("llama"), cell, ARGS, CPU, lambda: None, measure_row=again, dueling=fake_duel(more))
    assert len(again.calls) == 2 and all("peak" in o for _, _, o in again.calls)
    assert more == [[("enable", None), ("torchtune", None)]]  # the duels done were kept


def test_a_cell_cut_off_in_its_plan_rows_names_each_cap_s_plan_and_its_summary_holds_no_verdict(capsys):
    fake = FakeRun()

    def cut_off(w, method, steps, warmup, opts, device, more=None):
        if "peak" in opts and sum("peak" in o for _, _, o in fake.calls) == 2:
            raise KeyboardInterrupt  # the device call's timeout, in the third plan row
        return fake(w, method, steps, warmup, opts, device, more)

    cell: dict = {}
    saved = []
    with pytest.raises(KeyboardInterrupt):
        zoo.measure_cell(hf.tiny("llama"), cell, ARGS, CPU, lambda: saved.append(json.loads(json.dumps(cell))),
                         measure_row=cut_off, dueling=fake_duel([]))
    last = saved[-1]  # as the file holds it
    assert len([r for r in last["rows"] if r["method"] == zoo.PLAN]) == 2 and "complete" not in last
    # each measured plan row's cap names it in the file (the last one was saved before it was named)
    assert [c.get("plan") for c in last["caps"][:2]] == [zoo.plan_label(c["cap_bytes"]) for c in last["caps"][:2]]
    v = zoo_verdicts.verdicts(last)
    assert len(v["per_cap"]["caps"]) == 2 and not any(v[k]["holds"] for k in v)  # nothing holds in a cut-off cell
    whole = made_up_cell()  # whose every verdict holds, once complete: not before
    assert all(zoo_verdicts.verdicts(whole)[k]["holds"] for k in v)
    del whole["complete"]
    assert not any(zoo_verdicts.verdicts(whole)[k]["holds"] for k in v)
    del last["caps"][1]["plan"]  # as files written before that were: the cap is left out, the summary reads on
    first = round(last["caps"][0]["cap_bytes"] / GiB, 3)
    assert [c["cap_GiB"] for c in zoo_verdicts.verdicts(last)["per_cap"]["caps"]] == [first]
    assert "cut off before its end" in zoo_verdicts.table("llama-tiny", last)


def made_up_cell() -> dict:
    """A cell as zoo.py writes it, where every verdict holds."""
    cap = int(2.5 * GiB)
    rows = [{"label": "none", "method": "none", "step_ms": 100.0, "peak_GiB": 10.0},
            {"label": "checkpoint", "method": "checkpoint", "step_ms": 130.0, "peak_GiB": 3.0},
            {"label": "torchtune", "method": "torchtune", "step_ms": 700.0, "peak_GiB": 2.5, "peak_bytes": cap},
            {"label": "torchtune-checkpoint", "method": "torchtune-checkpoint", "step_ms": 200.0, "peak_GiB": 2.6},
            {"label": "storm-enable", "method": "storm-enable", "step_ms": 300.0, "peak_GiB": 2.5,
             "peak_bytes": cap + 10 * MiB},
            {"label": "enable peak=2.500GiB", "method": "enable-peak", "cap_bytes": cap, "step_ms": 140.0,
             "peak_GiB": 2.49, "peak_bytes": cap - 10 * MiB, "predicted_step_peak_bytes": cap - 30 * MiB,
             "predicted_from": "test"}]
    return {"workload": {"arch": "llama", "layers": 2, "hidden": 32, "batch": 2, "seq": 16}, "rows": rows,
            "complete": True,
            "meta": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01T00:00:00+00:00", "commit": "abcdef0"},
            "caps": [{"cap_bytes": cap, "sources": ["torchtune"], "plan": "enable peak=2.500GiB"}],
            "duels": [{"cap_bytes": cap, "plan": "enable peak=2.500GiB", "versus": ["torchtune", "checkpoint"],
                       "ms": [140.0, 700.0, 130.0], "first_over": [0.2, 1.077],
                       "first_over_95": [[0.19, 0.21], [1.05, 1.1]], "rounds": 5}],
            "full_duel": {"ms": [300.0, 700.0], "first_over": [0.429], "first_over_95": [[0.42, 0.44]],
                          "versus": ["torchtune"], "rounds": 5}}


def test_the_verdicts_hold_on_numbers_that_meet_them_and_fail_each_where_they_do_not():
    v = zoo_verdicts.verdicts(made_up_cell())
    assert v["per_cap"]["holds"] and v["per_cap"]["caps"][0]["x_best_other"] == 0.2
    assert v["least_cap"]["holds"] and v["least_cap"]["x_checkpoint"] == 1.077
    assert v["full_offload"]["holds"] and v["full_offload"]["peak_x_torchtune"] == round((2.5 * GiB + 10 * MiB)
                                                                                         / (2.5 * GiB), 4)
    assert v["predicted_peak"]["holds"] and v["predicted_peak"]["plans"][0]["off_MiB"] == -20.0
    cell = made_up_cell()  # the plan slower than torchtune in their duel
    cell["duels"][0]["first_over"][0] = 1.02
    assert not zoo_verdicts.verdicts(cell)["per_cap"]["holds"]
    cell = made_up_cell()  # its peak over the cap by a MiB: fails the cap, not the least cap's 1%
    cell["rows"][-1]["peak_bytes"] = cell["caps"][0]["cap_bytes"] + MiB
    v = zoo_verdicts.verdicts(cell)
    assert not v["per_cap"]["holds"] and v["least_cap"]["holds"]
    cell = made_up_cell()  # 1.2x checkpointing at the least cap
    cell["duels"][0]["first_over"][1] = 1.2
    assert not zoo_verdicts.verdicts(cell)["least_cap"]["holds"]
    cell = made_up_cell()  # full offload 2% above torchtune's peak
    cell["rows"][4]["peak_bytes"] = int(2.55 * GiB)
    assert not zoo_verdicts.verdicts(cell)["full_offload"]["holds"]
    cell = made_up_cell()  # predicted 100 MiB under a 2.5 GiB peak: more than 64 MiB and 3%
    cell["rows"][-1]["predicted_step_peak_bytes"] = cell["rows"][-1]["peak_bytes"] - 100 * MiB
    assert not zoo_verdicts.verdicts(cell)["predicted_peak"]["holds"]
    cell = made_up_cell()  # a duel that failed decides nothing
    cell["duels"] = [{"cap_bytes": cell["caps"][0]["cap_bytes"], "error": "OOM"}]
    del cell["full_duel"]
    v = zoo_verdicts.verdicts(cell)
    assert not v["per_cap"]["holds"] and not v["least_cap"]["holds"] and not v["full_offload"]["holds"]


def test_the_summary_prints_a_runs_tables_and_without_cuda_it_measures_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "zoo.json"
    out.write_text(json.dumps({"cells": {"llama-tiny": made_up_cell()}}))
    monkeypatch.setattr(sys, "argv", ["bench/zoo.py", "--summary", str(out), "--markdown"])
    assert zoo.main() == 0
    printed = capsys.readouterr().out
    assert "| enable peak=2.500GiB | 140.00 | 2.490 |" in printed and "full_offload: " in printed
    assert "NVIDIA H100 80GB HBM3, 2026-12-01, abcdef0" in printed
    assert zoo_verdicts.short_commit("abcdef0123+uncommitted") == "abcdef0+uncommitted"  # code no commit holds
    if not torch.cuda.is_available():  # as a user runs it
        r = run_bench("zoo.py", "--cells", "llama-wide", "--out", str(tmp_path / "new.json"))
        assert r.returncode == 2 and "CUDA" in r.stderr and not (tmp_path / "new.json").exists()


def test_a_duel_that_kept_another_plan_than_its_row_holds_only_where_that_plan_fits():
    """The duel plans afresh and its trials may keep another plan than the row measured: the cap
    holds only where the planner measured that plan's own step within its target (as
    plan_summary records it, or, in files written before, the one measured plan of its shape)."""
    def cell_with(chosen: dict) -> dict:
        cell = made_up_cell()
        row_plan = {"full_offload": False, "offloaded_blocks": 1, "recomputed_blocks": [1],
                    "inputs_offloaded_blocks": 0, "compressed": False, "fits": True}
        cell["rows"][-1]["plan"] = row_plan
        cell["duels"][0]["chosen"] = {**row_plan, **chosen}
        return cell

    same = zoo_verdicts.verdicts(cell_with({}))["per_cap"]["caps"][0]
    assert same["holds"] and not same["duel_plan_differs"]
    other = {"offloaded_blocks": 0, "recomputed_blocks": [0, 1]}
    within = zoo_verdicts.verdicts(cell_with({**other, "over_bytes": -5 * MiB}))["per_cap"]["caps"][0]
    assert within["holds"] and within["duel_plan_differs"] and within["duel_plan_over_MiB"] == -5.0
    just_over = cell_with({**other, "over_bytes": 4096})  # 4 KiB over: over, however it rounds
    over = zoo_verdicts.verdicts(just_over)
    assert not over["per_cap"]["holds"] and not over["per_cap"]["caps"][0]["fits"]
    assert "its own step 0.0 MiB over its target" in zoo_verdicts.table("llama-tiny", {**just_over, "verdicts": over})
    measured = [{"full_offload": False, "offloaded_blocks": 0, "recomputed": 2, "inputs_offloaded_blocks": 0,
                 "compressed": False, "over_MiB": -7.0}]
    older = zoo_verdicts.verdicts(cell_with({**other, "measured": measured}))["per_cap"]["caps"][0]
    assert older["holds"] and older["duel_plan_over_MiB"] == -7.0
    unknown = zoo_verdicts.verdicts(cell_with({**other, "measured": measured * 2}))["per_cap"]["caps"][0]
    assert not unknown["holds"] and unknown["duel_plan_over_MiB"] is None  # two of its shape: which is unknown
    # written by plan_summary since it records over_bytes: None is "not measured", whatever the list holds
    unmeasured = zoo_verdicts.verdicts(cell_with({**other, "over_bytes": None, "measured": measured}))
    unmeasured = unmeasured["per_cap"]["caps"][0]
    assert not unmeasured["holds"] and unmeasured["duel_plan_over_MiB"] is None
    # the row's blocks with another copy queue: another plan, judged by its own measure
    queue = {"max_held_bytes": 1 << 30, "prefetch_bytes": 0}
    cell = cell_with({**queue, "over_bytes": 300 * MiB})
    cell["rows"][-1]["plan"].update(max_held_bytes=1 << 20, prefetch_bytes=0)
    held = zoo_verdicts.verdicts(cell)["per_cap"]["caps"][0]
    assert held["duel_plan_differs"] and not held["holds"]


def test_merge_makes_the_files_of_a_process_per_gpu_one_run_and_refuses_two_runs(tmp_path, monkeypatch, capsys):
    """A machine of several GPUs measures a cell set per GPU, each process into its own file;
    --merge makes them one run's file, which --summary reads. Cells measured at two commits or on
    two kinds of device are not one run, nor is a cell found twice: refused, by name."""
    def cell(commit: str = "abcdef0", device: str = "NVIDIA H100 80GB HBM3") -> dict:
        c = made_up_cell()
        c["meta"] = {**c["meta"], "commit": commit, "device": device}
        return c

    def files(*runs: dict) -> list[str]:
        names = []
        for i, run in enumerate(runs):
            (tmp_path / f"gpu{i}.json").write_text(json.dumps(run))
            names.append(str(tmp_path / f"gpu{i}.json"))
        return names

    out = tmp_path / "run.json"
    names = files({"cells": {"llama-tiny": cell()}}, {"cells": {"mistral-tiny": cell()}})
    monkeypatch.setattr(sys, "argv", ["bench/zoo.py", "--merge", *names, "--out", str(out)])
    assert zoo.main() == 0
    assert set(json.loads(out.read_text())["cells"]) == {"llama-tiny", "mistral-tiny"}
    monkeypatch.setattr(sys, "argv", ["bench/zoo.py", "--summary", str(out)])
    assert zoo.main() == 0 and "mistral-tiny" in capsys.readouterr().out
    for other, said in ((cell(commit="1234567"), "more than one commit"),
                        (cell(device="NVIDIA H200"), "more than one kind of device")):
        with pytest.raises(ValueError, match=said):
            zoo_verdicts.merge([{"cells": {"llama-tiny": cell()}}, {"cells": {"mistral-tiny": other}}], ["a", "b"])
    resumed = cell()
    resumed["calls"] = [{**resumed["meta"], "commit": "1234567"}, resumed["meta"]]  # begun at another commit
    with pytest.raises(ValueError, match="more than one commit"):
        zoo_verdicts.merge([{"cells": {"llama-tiny": cell()}}, {"cells": {"mistral-tiny": resumed}}], ["a", "b"])
    with pytest.raises(ValueError, match="llama-tiny is in both a and b"):
        zoo_verdicts.merge([{"cells": {"llama-tiny": cell()}}, {"cells": {"llama-tiny": cell()}}], ["a", "b"])
